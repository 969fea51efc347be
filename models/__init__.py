"""The reference models built from minipar's parallel layers: llama.py, the Llama decoder with
Hugging Face's parameter names (TP and CP inside it; DDP and ZeRO-3 wrap it from outside)."""
