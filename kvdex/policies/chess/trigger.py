"""CHESS's quality-aware backtracking trigger (kvdex.policies.chess, §3.3): the thresholds (a
`kvdex calibrate chess` file, explicit values or the defaults) and the per-sequence check of the
entropy / varentropy of the next-token distribution every ``check_every`` decode steps.

:func:`load_thresholds` reads the thresholds (when the policy is made, so a bad file fails early);
:class:`Trigger` owns a bound policy's running sums, its pending check and the check counters, and
:meth:`Trigger.due` answers, after each decode step, which sequences to rebuild.

A check's result takes effect one decode step late: the check's statistics are computed on the device
and copied to pinned host memory without waiting, and the next step's ``on_step`` reads them (by then
the step that produced them has finished, while the following one already runs). Reading them at once
would make the host wait for the GPU at every check, so the step after it would start from an idle
device (about 0.14 ms a step over a page at the 8B shape, ``docs/policies/chess.md``). A rebuild the
check asks for is therefore requested after the step that follows the check, and logged at that step.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvdex.kernels.dispatch import triton_kernel
from kvdex.policies.chess.levels import entropy_varentropy

# Default thresholds when neither a calibration file nor explicit values are given: the 99th
# percentiles measured by `kvdex calibrate chess` on SmolLM2-135M-Instruct (CPU, fp32): LongBench v1
# gov_report/qmsum/multi_news/samsum/lcc (the last 3 samples of each), prompts of 3072 tokens, 192
# greedy tokens with full attention, 76 pages of 32 generated tokens (docs/policies/chess.md,
# docs/policies/chess_calibration_smollm2.json). Thresholds are model-specific: calibrate yours.
DEFAULT_THRESHOLDS = {"entropy": 2.6133, "varentropy": 6.3457, "temporal_varentropy": 3.5523}


def load_thresholds(thresholds: str, entropy: float | None, varentropy: float | None, kind: str) -> tuple[float, float]:
    """(entropy, varentropy) thresholds: explicit values, else the ``thresholds`` file's (a `kvdex calibrate
    chess` output), else :data:`DEFAULT_THRESHOLDS`; ``kind``: the varentropy statistic (output | temporal)."""
    table = dict(DEFAULT_THRESHOLDS)
    if thresholds:
        path = Path(thresholds).expanduser()
        if not path.is_file():
            raise ValueError(f"CHESS thresholds file {path} not found; write it with `kvdex calibrate chess`")
        try:
            data = json.loads(path.read_text())
            table = {k: float(data[k]) for k in DEFAULT_THRESHOLDS}
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"CHESS thresholds file {path} is not a `kvdex calibrate chess` output "
                f"(needs numbers {', '.join(DEFAULT_THRESHOLDS)}): {e}"
            ) from None
    h = table["entropy"] if entropy is None else float(entropy)
    key = "varentropy" if kind == "output" else "temporal_varentropy"
    v = table[key] if varentropy is None else float(varentropy)
    return h, v


class Trigger:
    """When a bound policy rebuilds: ``kind`` (uncertainty | interval | always | never), ``interval``
    (decode steps between interval rebuilds), ``every`` (decode steps per uncertainty check),
    ``varentropy`` (output | temporal), ``combine`` (and | or) and the thresholds ``tau`` (entropy,
    varentropy)."""

    def __init__(
        self, kind: str, *, interval: int, every: int, varentropy: str, combine: str, tau: tuple[float, float]
    ) -> None:
        self.kind = kind
        self.interval = interval
        self.every = every
        self.varentropy = varentropy
        self.combine = combine
        self.tau = tau
        self.acc: torch.Tensor | None = None  # per-sequence sums since the last check: H, H^2, V, steps
        self.nacc = 0  # steps in those sums
        self.check: tuple[int, torch.Tensor, torch.cuda.Event | None] | None = None  # the last check, read next step
        self.checks = 0  # trigger evaluations summed over sequences
        self.check_log: list[tuple[int, int, float, float]] = []  # (step, sequence, entropy, varentropy stat)

    def drop_check(self) -> None:
        """Forget the check in flight (the context changed: every sequence is rebuilt anyway)."""
        self.check = None

    def due(self, step: int, logits: torch.Tensor | None, batch: int) -> torch.Tensor | None:
        """Sequences of ``batch`` whose selection is rebuilt after decode step ``step``: [B] bool, or None."""
        b = batch
        if self.kind == "never":
            return None
        if self.kind == "always":
            return torch.ones(b, dtype=torch.bool)
        if self.kind == "interval":
            return torch.ones(b, dtype=torch.bool) if step % self.interval == 0 else None
        due = self._read_check()  # the last check's result, one step late
        if logits is None:
            return due
        fused = triton_kernel("entropy_triton", "accumulate", on=logits)
        if fused is not None:  # CUDA: one kernel (kvdex.kernels.entropy_triton)
            if self.acc is None:
                self.acc = torch.zeros(4, b, dtype=torch.float32, device=logits.device)
            fused(logits, self.acc)
        else:
            h, v = entropy_varentropy(logits)
            acc = torch.stack([h, h.square(), v, torch.ones_like(h)])
            self.acc = acc if self.acc is None else self.acc + acc
        self.nacc += 1
        if self.nacc < self.every:
            return due
        h_page, v_page = self.page_stats(self.acc)
        exceed = self.exceeds(h_page, v_page)
        self.acc, self.nacc = None, 0
        self.checks += b
        self._send_check(step, torch.stack([h_page, v_page, exceed.to(h_page.dtype)]))
        return due

    def _send_check(self, step: int, stats: torch.Tensor) -> None:
        """Start copying a check's [3, B] (entropy, varentropy statistic, exceeded) to the host, unwaited."""
        if not stats.is_cuda:
            self.check = (step, stats, None)
            return
        host = torch.empty(stats.shape, dtype=stats.dtype, pin_memory=True)
        with torch.cuda.device(stats.device):
            host.copy_(stats, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        self.check = (step, host, done)

    def _read_check(self) -> torch.Tensor | None:
        """The sequences [B] bool whose last sent check exceeded the thresholds (None: none, or no check)."""
        if self.check is None:
            return None
        step, host, done = self.check
        self.check = None
        if done is not None:
            done.synchronize()  # the check's own step, already finished or about to
        h_page, v_page, exceed = host.tolist()
        self.check_log += [(step, i, h, v) for i, (h, v) in enumerate(zip(h_page, v_page, strict=True))]
        rows = torch.tensor(exceed) > 0.5
        return rows if bool(rows.any()) else None

    def page_stats(self, acc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean entropy, varentropy statistic) [B] from sums acc [4, B] = (H, H^2, V, steps)."""
        n = acc[3]
        h_mean = acc[0] / n
        if self.varentropy == "output":
            return h_mean, acc[2] / n
        return h_mean, (acc[1] / n - h_mean.square()).clamp(min=0)

    def exceeds(self, h: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        th, tv = self.tau
        return (h > th) & (v > tv) if self.combine == "and" else (h > th) | (v > tv)
