"""Pipeline a HuggingFace GPT-2 as it is: name the split point and the loss, nothing else.

    torchrun --nproc-per-node 2 examples/pipeline_hf_gpt2.py [--schedule 2bw] [--steps 30]

Each rank builds the same model from a config (no download; the input embedding and the
output head stay tied), the pipeline splits it at ``transformer.h.N`` with torch's tracer,
each rank keeps its stage, and syncline's schedule trains it on byte-level text from the
Python standard library's ``os.py``. The tied copies on the first and the last stage get
their gradients summed before each step; the script checks at the end that they are equal.
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers

from syncline import Pipeline


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy; padded positions carry label -100."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def batches(seq: int, batch: int, steps: int):
    data = torch.frombuffer(bytearray(Path(sysconfig.get_paths()["stdlib"], "os.py").read_bytes()),
                            dtype=torch.uint8).long()  # fmt: skip
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - seq, (batch,), generator=g)
        ids = torch.stack([data[s : s + seq] for s in starts.tolist()])
        mask = torch.ones_like(ids)
        yield {"input_ids": ids, "attention_mask": mask}, ids


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedule", default="2bw", choices=["gpipe", "1f1b", "2bw"])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()  # one stage per rank: 2 to 4 (the 4 blocks)
    cfg = transformers.GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=256,
                                  n_positions=64, use_cache=False, bos_token_id=0,
                                  eos_token_id=0)  # fmt: skip
    torch.manual_seed(0)  # the same weights on every rank
    model = transformers.GPT2LMHeadModel(cfg)
    points = [f"transformer.h.{4 * i // world}" for i in range(1, world)]
    pipe = Pipeline(model, num_stages=world, num_microbatches=4, schedule=args.schedule,
                    loss_fn=lm_loss, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                    split_points=points)  # fmt: skip
    data = batches(seq=64, batch=16, steps=args.steps + 1)
    for step in range(args.steps):
        loss = pipe.train_step(data)
        if dist.get_rank() == 0 and step % 5 == 0:
            print(f"step {step:3d}  loss {loss:.4f}", flush=True)
    pipe.flush()
    state = pipe.local_state_dict()
    mine = state.get("transformer.wte.weight", state.get("lm_head.weight"))
    if mine is None:  # a middle stage holds neither copy
        mine = torch.zeros(cfg.vocab_size, cfg.n_embd)
    copies = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(copies, mine.contiguous())
    if dist.get_rank() == 0:
        same = torch.equal(copies[0], copies[-1])
        print(f"tied embedding and head equal on the first and last stage: {same}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
