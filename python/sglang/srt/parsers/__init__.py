"""Reading a chat format's output back: reasoning (``reasoning_content``) and tool calls
(``tool_calls``), streamed chunk by chunk without ever showing partial markup as content, and the
grammars that make ``tool_choice`` ``required`` or a named function hold."""
