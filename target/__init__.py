"""Target models: Llama-family definitions (``model``), their config (``config``), weight
loading from HF folders and GGUF files (``loader``) and the paged-KV ``ModelRunner``."""
