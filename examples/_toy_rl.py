"""Tiny pure-PyTorch RL toy: a small transformer learns to copy digits by REINFORCE.

Task: the prompt is ``K`` random digits (0-9).  After a separator token the
policy generates ``K`` digits autoregressively; the reward is the fraction of
generated digits that equal the prompt digit at the same position (chance is
0.1).  With REINFORCE + a moving-average baseline (256 samples per step,
Adam lr 5e-3) the mean reward rises from ~0.1 to ~0.5-0.9 within 30 steps,
a few seconds on one CPU thread.

The pieces are split so a demo can sample in one process (``make_prompts`` +
``sample`` on whatever weights the policy currently holds) and train in
another (``reward`` + ``Trainer.step``).  Learning tolerates actions sampled
from weights one optimizer step stale (see ``--stale``).

Run ``python examples/_toy_rl.py [--seed N] [--stale] [--steps 30]``.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import time

import torch
from torch import nn

__all__ = [
    "K", "NUM_DIGITS", "SEP", "VOCAB", "BATCH", "LR", "TaskPolicy", "build_policy", "make_prompts",
    "sample", "reward", "Trainer", "main", "weights_digest",
]

K = 4               # prompt length == number of generated tokens
NUM_DIGITS = 10     # action vocabulary: digits 0..9
SEP = NUM_DIGITS    # separator token id (input vocabulary only)
VOCAB = NUM_DIGITS + 1
MAX_LEN = 2 * K + 1  # prompt + SEP + K actions (the last action is never fed back)
BATCH = 256         # default samples per optimizer step
LR = 5e-3           # default Adam learning rate


class TaskPolicy(nn.Module):
    """Causal transformer: tokens [B, L] -> next-digit logits [B, L, NUM_DIGITS]."""

    def __init__(self, d_model: int = 64, nhead: int = 4, dim_ff: int = 128, layers: int = 2):
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, d_model)
        self.pos_emb = nn.Embedding(MAX_LEN, d_model)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, nhead, dim_ff, dropout=0.0,
                                       batch_first=True, norm_first=True)
            for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, NUM_DIGITS)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        pos = torch.arange(length, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))


def weights_digest(module: nn.Module) -> str:
    """sha256 over every tensor's name and bytes, in state-dict order (the examples compare trainer and
    generators with it)."""
    h = hashlib.sha256()
    for name, t in module.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def build_policy(seed: int = 0) -> TaskPolicy:
    """Build the policy on CPU, float32, deterministically from ``seed``
    (the global RNG state is left untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TaskPolicy().float()


def _device_of(policy: nn.Module) -> torch.device:
    return next(policy.parameters()).device


def make_prompts(batch: int, generator: torch.Generator,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """Random digit prompts, int64 [batch, K], drawn on ``generator``'s device
    and moved to ``device`` (default: the generator's device)."""
    prompts = torch.randint(0, NUM_DIGITS, (batch, K), generator=generator,
                            device=generator.device)
    return prompts.to(device if device is not None else generator.device)


def _inputs(prompts: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """Model input: prompt, SEP, then the actions generated so far."""
    sep = torch.full((prompts.shape[0], 1), SEP, dtype=torch.long, device=prompts.device)
    return torch.cat([prompts, sep, actions], dim=1)


@torch.no_grad()
def sample(policy: nn.Module, prompts: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Sample K actions autoregressively from ``policy``'s softmax; int64 [batch, K]
    on the policy's device.  Uses only ``policy.forward``."""
    device = _device_of(policy)
    prompts = prompts.to(device)
    actions = torch.empty((prompts.shape[0], 0), dtype=torch.long, device=device)
    for _ in range(K):
        probs = torch.softmax(policy(_inputs(prompts, actions))[:, -1].float(), dim=-1)
        nxt = torch.multinomial(probs.to(generator.device), 1, generator=generator)
        actions = torch.cat([actions, nxt.to(device)], dim=1)
    return actions


def reward(prompts: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """Fraction of positions where the action copies the prompt; float32 [batch] in [0, 1]."""
    return (actions.to(prompts.device) == prompts).float().mean(dim=1)


class Trainer:
    """REINFORCE with a moving-average baseline and one Adam step per call."""

    def __init__(self, policy: nn.Module, lr: float = LR, baseline_decay: float = 0.8,
                 max_grad_norm: float = 1.0):
        self.policy = policy
        self.opt = torch.optim.Adam(policy.parameters(), lr=lr)
        self.baseline_decay = baseline_decay
        self.max_grad_norm = max_grad_norm
        self.baseline: float | None = None

    def log_probs(self, prompts: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """Per-token log-probs of ``actions`` under the current policy (teacher forcing), [B, K]."""
        logits = self.policy(_inputs(prompts, actions[:, :-1]))[:, K:]
        return torch.log_softmax(logits.float(), dim=-1).gather(-1, actions[..., None])[..., 0]

    def step(self, prompts: torch.Tensor, actions: torch.Tensor, rewards: torch.Tensor) -> dict:
        device = _device_of(self.policy)
        prompts, actions = prompts.to(device), actions.to(device)
        rewards = rewards.to(device, torch.float32)
        mean_r = rewards.mean().item()
        if self.baseline is None:
            self.baseline = mean_r
        advantage = rewards - self.baseline
        loss = -(advantage * self.log_probs(prompts, actions).sum(dim=1)).mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(self.policy.parameters(), self.max_grad_norm)
        self.opt.step()
        self.baseline = self.baseline_decay * self.baseline + (1 - self.baseline_decay) * mean_r
        return {"loss": loss.item(), "mean_reward": mean_r}


def main(argv: list[str] | None = None) -> list[float]:
    """Single-process self-check; returns the per-step mean rewards."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=BATCH)
    ap.add_argument("--lr", type=float, default=LR)
    ap.add_argument("--stale", action="store_true",
                    help="sample from a copy of the policy one optimizer step behind")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    device = torch.device(args.device)
    policy = build_policy(args.seed).to(device)
    sampler = copy.deepcopy(policy) if args.stale else policy
    trainer = Trainer(policy, lr=args.lr)
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    curve: list[float] = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        prompts = make_prompts(args.batch, gen, device)
        actions = sample(sampler, prompts, gen)
        if args.stale:  # refresh after sampling: next step samples from these (now old) weights
            sampler.load_state_dict(policy.state_dict())
        stats = trainer.step(prompts, actions, reward(prompts, actions))
        curve.append(stats["mean_reward"])
        print(f"step {step:3d}  mean_reward {stats['mean_reward']:.3f}  loss {stats['loss']:+.3f}",
              flush=True)
    wall = time.perf_counter() - t0
    first, last = sum(curve[:5]) / 5, sum(curve[-5:]) / 5
    print(f"first5 {first:.3f}  last5 {last:.3f}  wall {wall:.1f}s  "
          f"params {sum(p.numel() for p in policy.parameters())}  stale={args.stale}")
    if last < first + 0.25:
        raise SystemExit(f"reward did not rise enough: first5 {first:.3f} -> last5 {last:.3f}")
    return curve


if __name__ == "__main__":
    main()
