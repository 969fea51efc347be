"""Your own training loop on any layout, with minipar as a library (minipar/api.py).

    python examples/own_loop.py                                   one process
    PARALLELISM_CONFIG_DP_SHARD_SIZE=2 PARALLELISM_CONFIG_TP_SIZE=2 \\
        torchrun --nproc-per-node 4 examples/own_loop.py           ZeRO-3 over 2 x TP over 2

Every rank reads the same global batch; `step` keeps this rank's share, so the losses are those
of one process on every layout (tests/test_api.py runs this file on 4 ranks against 1).
"""
import argparse

import torch
import torch.distributed as dist

import minipar
from minipar.api import prepare
from models.llama_config import LlamaConfig


def main(steps=20, sizes=None, micro_batches=1, **settings):
    pgm = minipar.init(minipar.ParallelismConfig(**sizes) if sizes else None)   # None: the environment
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2)         # or "path/to/hf_model"
    model, optimizer, step = prepare(config, pgm, learning_rate=3e-3, warmup_steps=5, max_steps=steps,
                                     micro_batches=micro_batches, **settings)
    text = torch.tensor(list(open("data/shakespeare.txt", "rb").read()))     # bytes as tokens
    order = torch.Generator().manual_seed(0)                                 # the same on every rank
    losses = []
    for i in range(steps):
        starts = torch.randint(0, len(text) - 65, (8,), generator=order)
        ids = torch.stack([text[s:s + 65] for s in starts.tolist()])       # 8 windows of 64 + 1
        out = step(ids[:, :-1], ids[:, 1:])                                  # the global batch
        losses.append(float(out["loss"]))                                    # a host read: log-time only
        if pgm.global_rank == 0 and i % 5 == 4:
            print(f"step {i + 1}: loss {losses[-1]:.4f}, grad_norm {float(out['grad_norm']):.3f}")
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="your own loop on any layout (sizes: PARALLELISM_CONFIG_*)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    main(parser.parse_args().steps)
    dist.destroy_process_group()            # every group closed while Python is whole
