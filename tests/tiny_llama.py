"""The tiny Llama and the seeded global batches that the data-parallel and ZeRO-3 tests share."""
import torch

CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2)
B, T = 8, 8


def tiny_batch(step):
    """The global batch (B, T) of `step`; some labels ignored, so token counts differ by rank."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, CFG["vocab_size"], (B, T), generator=g)
    labels = torch.randint(0, CFG["vocab_size"], (B, T), generator=g)
    labels[0, :3] = -100
    labels[5, 4:] = -100
    return ids, labels
