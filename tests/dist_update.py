"""One logprobs + update of the tiny model on a fixed batch; run by tests/test_dist.py both as a plain
process and under `torchrun --nproc_per_node=2` (gloo), where rank 0 starts with 3/4 of the samples
and fsdp.balance_tokens evens them out. Writes the loss, the updated full weights and the tokens
each rank trained on (rank 0) to argv[1]."""

import os
import random
import sys

import torch

import fsdp
import ppo
import train
from rollout import Sample
from tiny import build_tiny


def fixed_batch(n=48, vocab=20):
    rng = random.Random(0)
    out = []
    for i in range(n):
        p, r = rng.randint(3, 12), rng.randint(1, 4)
        out.append(
            Sample(
                [rng.randrange(3, vocab) for _ in range(p)],
                [rng.randrange(3, vocab) for _ in range(r)],
                [-rng.random() for _ in range(r)],
                0.0,
                False,
                True,
                i // 4,
                i,
                "",
                0,
            )
        )
    return out, [rng.uniform(-1, 1) for _ in range(n)]


if __name__ == "__main__":
    cfg = train.Config(mini_batch=1000, micro_batch_tokens=64, kl_coef=0.0)  # one optimizer step
    rank, world, device = fsdp.setup_dist(cfg)

    def reached(phase):  # on stderr, which the test shows if a rank dies: where each one got to
        sys.stderr.write(f"dist_update rank {rank}: {phase}\n")  # one write: the ranks share stderr
        sys.stderr.flush()

    torch.set_num_threads(1)
    model, tok = build_tiny("treasure", seed=0)
    model = fsdp.shard(model.eval(), device, grad_ckpt="--grad_ckpt" in sys.argv)  # eval: as from_pretrained
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: 1.0)
    samples, adv = fixed_batch()
    cut = len(samples) * 3 // 4 if world == 2 else len(samples)  # rank 0 plays 3/4 of the samples,
    lo, hi = (0, cut) if rank == 0 else (cut, len(samples))  # then the ranks balance tokens
    samples, adv = fsdp.balance_tokens(samples[lo:hi], adv[lo:hi])
    tokens = [
        fsdp.all_reduce(sum(len(x.prompt_ids) + len(x.response_ids) for x in samples) * (r == rank))
        for r in range(world)
    ]
    reached("balanced")
    old = ppo.logprobs(model, samples, cfg=cfg, device=device, pad_id=tok.pad_token_id, packed=False)
    reached("old log-probs")
    stats = ppo.update(
        model,
        opt,
        sched,
        samples,
        old=old,
        ref=None,
        adv=adv,
        cfg=cfg,
        device=device,
        pad_id=tok.pad_token_id,
        packed=False,
    )
    reached("updated")
    weights = {n: t.clone() for n, t in fsdp.full_parameters(model)}
    if rank == 0:
        torch.save(
            {
                "loss": stats["loss"],
                "grad_norm": stats["grad_norm"],
                "weights": weights,
                "tokens": tokens,
                "longest": max(len(x.prompt_ids) + len(x.response_ids) for x in fixed_batch()[0]),
            },
            sys.argv[1],
        )
    reached("saved")
    if fsdp.dist_on():
        # leave together, and without tearing gloo down: rank 1 aborted ("terminate called without
        # an active exception") in two CI runs, the second with a barrier before destroy_process_group
        # here (where it died was not shown then: `reached` says now); os._exit skips the group's and
        # the interpreter's teardown
        fsdp.barrier()
        reached("at the barrier")
        sys.stdout.flush()
        os._exit(0)
