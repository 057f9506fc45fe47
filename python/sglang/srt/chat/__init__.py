"""Chat encodings: OpenAI-style messages (plus tools, tool choice, response format and thinking)
-> the prompt a model was trained on. One file per model format, chosen by the checkpoint's model
type through :mod:`registry`; a Jinja template (the tokenizer's own or ``--chat-template``) for
everything else."""
