"""What the server, the worker and the load generator share, without torch: where model
files are, the tokenizer and chat templates, and integer helpers."""
