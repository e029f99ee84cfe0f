"""What a step optimises: the loop calls `objective.micro(model, mb)` per micro-batch and never asks which task runs.

- SFT: the summed token cross-entropy, normalised by the global batch's loss tokens.
- Preference (task dpo): per pair, a loss of the chosen and the rejected answer's summed log-probabilities under the
  policy (and, for DPO and IPO, under a frozen reference), normalised by the global batch's pairs. The formulas:

  DPO (Rafailov et al. 2023, eq. 7), with the log-ratios r_w = log pi(y_w|x) - log ref(y_w|x) and r_l alike:
      loss = -log sigmoid(beta (r_w - r_l)),                  rewards beta r_w, beta r_l
  IPO (Azar et al. 2023, eq. 17), h = r_w - r_l:
      loss = (h - 1 / (2 beta))^2,                             rewards beta r_w, beta r_l
  SimPO (Meng et al. 2024, eq. 6), no reference; |y| the answer's tokens:
      loss = -log sigmoid(beta log pi(y_w|x) / |y_w| - beta log pi(y_l|x) / |y_l| - gamma)
  ORPO (Hong et al. 2024, eqs. 4-7), no reference; p = exp(log pi(y|x) / |y|), odds(y) = p / (1 - p):
      loss = -log pi(y_w|x) / |y_w| - beta log sigmoid(log odds(y_w) - log odds(y_l))
  SimPO and ORPO report beta x the length-normalised log-probability as the rewards.

The reference's log-probabilities come from a `Reference`: a frozen copy wrapped by the strategy (sharded like the
policy under fsdp and zero3), the policy itself with its adapters off (LoRA), or a table computed before training
(--precompute-ref, the model freed afterwards).
"""

from __future__ import annotations

import gc

import torch
import torch.nn.functional as F

from shardwise.models.speed import IGNORE, token_logprobs, token_loss_sum

PREFERENCE_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")


class SFT:
    """Supervised fine-tuning: the summed token loss over the global batch's loss tokens."""

    names = ("loss",)

    def denominator(self, batch) -> int:
        return batch.loss_tokens

    def micro(self, model, mb, fused_head, want_aux: bool = False):
        """(summed loss, the logged extras (None), the MoE router's aux loss or None) of one micro-batch."""
        if fused_head is not None:  # the head returns the summed loss (models/speed.py)
            fused_head.loss_targets = mb.targets
            try:
                out = model(input_ids=mb.input_ids, position_ids=mb.position_ids)
            finally:
                fused_head.loss_targets = None
            summed = out.logits
        else:
            out = model(input_ids=mb.input_ids, position_ids=mb.position_ids)
            summed = token_loss_sum(out.logits, mb.targets)
        aux = out.aux_loss if want_aux else None
        del out  # the output holds the full logits: gone before backward (the loss kept what it needs)
        return summed, None, aux


def sequence_logps(model, mb, fused_head) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probability of each row's target tokens (B,), fp32; the number of those tokens (B,))."""
    if fused_head is not None:
        fused_head.logp_targets = mb.targets
        try:
            tok = model(input_ids=mb.input_ids, position_ids=mb.position_ids).logits
        finally:
            fused_head.logp_targets = None
    else:
        tok = token_logprobs(model(input_ids=mb.input_ids, position_ids=mb.position_ids).logits, mb.targets)
    valid = mb.targets != IGNORE
    return tok.sum(-1), valid.sum(-1).to(torch.float32)


def preference_loss(kind: str, beta: float, gamma: float, pol: torch.Tensor, n: torch.Tensor,
                    ref: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss per pair, chosen reward, rejected reward) from the rows' summed log-probabilities `pol` (chosen rows
    first, then rejected), their token counts `n` and the reference's `ref` (None for simpo/orpo)."""
    b = pol.shape[0] // 2
    pw, pl, nw, nl = pol[:b], pol[b:], n[:b], n[b:]
    if kind in ("sigmoid", "ipo"):
        rw, rl = pw - ref[:b], pl - ref[b:]
        if kind == "sigmoid":
            loss = -F.logsigmoid(beta * (rw - rl))
        else:
            loss = (rw - rl - 1 / (2 * beta)) ** 2
        return loss, beta * rw.detach(), beta * rl.detach()
    aw, al = pw / nw, pl / nl
    if kind == "simpo":
        loss = -F.logsigmoid(beta * (aw - al) - gamma)
    else:  # orpo: log odds(y) = log p - log(1 - p), p = exp(mean log-probability) < 1
        def log_odds(a):
            a = a.clamp(max=-1e-6)
            return a - torch.log(-torch.expm1(a))

        loss = -aw - beta * F.logsigmoid(log_odds(aw) - log_odds(al))
    return loss, beta * aw.detach(), beta * al.detach()


class Preference:
    """task dpo: one forward of the micro-batch's 2B rows (B chosen, then B rejected), the per-pair loss, and the
    rewards logged beside it (PREFERENCE_METRICS, the names TRL logs)."""

    names = ("loss", *PREFERENCE_METRICS)

    def __init__(self, cfg, reference):
        self.kind, self.beta, self.gamma = cfg.loss_type, cfg.beta, cfg.simpo_gamma
        self.reference = reference  # None for simpo/orpo

    def denominator(self, batch) -> int:
        return batch.units

    def micro(self, model, mb, fused_head, want_aux: bool = False):
        ref = None
        if self.reference is not None:  # first: the policy's activations are not held while it runs
            with torch.no_grad():
                ref = self.reference.logps(model, mb, fused_head)
        pol, n = sequence_logps(model, mb, fused_head)
        loss, rw, rl = preference_loss(self.kind, self.beta, self.gamma, pol, n, ref)
        extras = torch.stack([rw.sum(), rl.sum(), (rw - rl).sum(), (rw > rl).float().sum()])
        return loss.sum(), extras, None


# -- references --------------------------------------------------------------------------------------------------


class FrozenModel:
    """A separate reference model, wrapped by the run's strategy (Strategy.wrap_reference)."""

    def __init__(self, model, fused_head):
        self.model, self.fused_head = model, fused_head

    def logps(self, policy, mb, fused_head) -> torch.Tensor:
        return sequence_logps(self.model, mb, self.fused_head)[0]

    def free(self) -> None:
        self.model = self.fused_head = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


class AdaptersOff:
    """LoRA: the policy itself with its adapters disabled is the base model. Each adapted layer's own switch
    (peft's `disable_adapters`, which its forward reads) is turned, not peft's `disable_adapter()`, which also turns
    requires_grad off on the adapters for the duration: the adapters keep requiring gradients, because FSDP2 fixes a
    unit's gradient dtype at its first forward from the parameters that require them then, and the reference's
    forward comes first (without them FSDP would reduce the adapters' bf16 gradients and not cast them back to the
    adapters' fp32)."""

    def __init__(self, peft_model):
        from peft.tuners.tuners_utils import BaseTunerLayer

        self.peft = peft_model
        self.layers = [m for m in peft_model.modules() if isinstance(m, BaseTunerLayer)]

    def logps(self, policy, mb, fused_head) -> torch.Tensor:
        for m in self.layers:
            m._disable_adapters = True
        try:
            return sequence_logps(policy, mb, fused_head)[0]
        finally:
            for m in self.layers:
                m._disable_adapters = False

    def free(self) -> None:
        pass


class Table:
    """--precompute-ref: every row's reference log-probability, computed before training (`precompute`)."""

    def __init__(self, values: torch.Tensor):
        self.values = values

    def logps(self, policy, mb, fused_head) -> torch.Tensor:
        return self.values[torch.tensor(mb.rows, device=self.values.device)].to(mb.input_ids.device)


def precompute(reference, policy, sampler, dp_size: int, dp_rank: int, device, contexts, fused_head,
               all_reduce) -> Table:
    """Each data-parallel rank computes the reference log-probabilities of its share of the pairs (every rank runs
    the same number of micro-batches: a sharded reference gathers its weights collectively), then one sum over the
    ranks gives every rank the whole table."""
    units = list(range(sampler.units))
    mine = units[dp_rank::dp_size]
    per = -(-len(units) // dp_size)
    table = torch.zeros(len(sampler.data), dtype=torch.float32, device=device)
    for lo in range(0, per, sampler.mbs):
        part = mine[lo: lo + sampler.mbs]
        mb = _to(sampler.collate(sampler.rows_of(part or units[:1])), device)
        with torch.no_grad(), contexts():
            got = reference.logps(policy, mb, fused_head)
        if part:
            table[torch.tensor(mb.rows, device=device)] = got.float()
    all_reduce(table)
    return Table(table)


def _to(mb, device):
    from dataclasses import replace

    return replace(mb, input_ids=mb.input_ids.to(device), targets=mb.targets.to(device),
                   position_ids=mb.position_ids.to(device))


def build(cfg, model_dir: str, strategy, policy, frozen=None):
    """The run's objective: SFT, or Preference with its reference (none for simpo/orpo; the policy with its
    adapters off under LoRA; else the reference model loaded and wrapped by the strategy, frozen, no optimizer).
    `frozen`: what makes that wrapped reference instead, (module, fused head) (the rehearsal's random weights)."""
    if cfg.task != "dpo":
        return SFT()
    if cfg.loss_type in ("simpo", "orpo"):
        return Preference(cfg, None)
    if cfg.tuner != "full":
        return Preference(cfg, AdaptersOff(strategy.unwrap(policy)))
    if frozen is not None:
        return Preference(cfg, FrozenModel(*frozen()))
    from shardwise.models.load import load_model

    ref = load_model(cfg.ref_model or model_dir, strategy.reference_dtype(), cfg.trust_remote_code)
    return Preference(cfg, FrozenModel(*strategy.wrap_reference(ref)))


def describe(objective, cfg, strategy) -> str:
    """The run header's words for the task: '' for SFT."""
    if not isinstance(objective, Preference):
        return ""
    ref = objective.reference
    where = ("none (reference-free)" if ref is None else "the base model with the adapters off"
             if isinstance(ref, AdaptersOff) else "log-probabilities precomputed, model freed"
             if isinstance(ref, Table) else f"{cfg.ref_model or 'the starting model'}, {strategy.reference_layout()}")
    extra = f", simpo_gamma {cfg.simpo_gamma:g}" if cfg.loss_type == "simpo" else ""
    return f"task dpo: loss {cfg.loss_type}, beta {cfg.beta:g}{extra}; reference: {where}"
