"""The model: Llama-family decoder in torch, its config, weight loading (GGUF, safetensors),
weight forms and the start-up probe that picks one, and the compiled forward."""
