"""The text the default tokenizer's merges are learned from (written for this project).

Plain English about everyday things and about serving language models, with digits and
punctuation, so common words become single tokens and anything else falls back to bytes.
"""

from __future__ import annotations

CORPUS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog, and the dog does not mind at all.",
    "A language model reads a prompt, one token at a time, and writes the next token.",
    "The server keeps many requests in one batch so the machine is never idle.",
    "When a request is finished, its cache is freed and another request takes its place.",
    "Long prompts are split into chunks, and each chunk is processed with the running decodes.",
    "Hello! How are you today? I am fine, thank you. What would you like to talk about?",
    "Please write a short story about a small robot who learns to paint the sea.",
    "Once upon a time there was a little village by the river, where people baked bread.",
    "The weather is sunny in the morning, cloudy at noon, and it rains in the evening.",
    "One, two, three, four, five, six, seven, eight, nine, ten: 1 2 3 4 5 6 7 8 9 10.",
    "In 2024 the team measured 128 tokens per second on 8 GPUs with a batch of 64 requests.",
    "Mixture of experts models route every token to a few experts chosen by a small router.",
    "Attention looks back over the previous tokens; a sliding window keeps only the recent ones.",
    "Compressed entries summarise blocks of tokens, so very long contexts stay affordable.",
    "She opened the window, looked at the garden, and smiled at the birds in the old tree.",
    "He said that the answer was forty two, but nobody knew what the question had been.",
    "We should test the system with simple inputs first, then with large and strange ones.",
    "Water boils at 100 degrees Celsius at sea level and freezes at 0 degrees.",
    "The cat sat on the mat; the mat was red, and the cat was black and white.",
    "Good morning, good afternoon, good evening, and good night to everyone here.",
    "This model has random weights, so whatever it writes is only noise made of tokens.",
    "Questions and answers: what is your name? My name is Ada. Where do you live? In Paris.",
    "Temperature, top p, top k and min p change how the next token is sampled.",
    "def main():\n    print('hello world')\n    return 0\n",
    "for i in range(10):\n    total = total + i * 2\n",
    '{"role": "user", "content": "Tell me a joke about computers."}',
    "The library opens at nine o'clock and closes at six; books are due in two weeks.",
    "Mountains, rivers, forests and deserts: the world is large and full of places to see.",
    "If you are reading this, the tokenizer works and the engine is alive.",
    # Chat markup (DeepSeek V4's tool calls, JSON answers), so it tokenizes in few tokens.
    (
        '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter '
        'name="city" string="true">Paris</｜DSML｜parameter>\n<｜DSML｜parameter name="days" '
        'string="false">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
    ),
    (
        '<｜DSML｜invoke name="search">\n<｜DSML｜parameter name="query" string="true">the '
        "weather</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
    ),
    '{"name": "Ada", "age": 36, "city": "Paris", "tags": ["a", "b"], "ok": true, "n": null}',
    '{"query": "weather", "days": 7, "unit": "celsius", "results": [1, 2, 3], "done": false}',
)
