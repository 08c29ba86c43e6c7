"""The arithmetic-intensity table of the design notes, for any model shape and hardware.

Per decode token at context T, per prefill of N tokens, the ridge point, and what a
preempted request costs to swap out and back in versus to recompute. Every number comes
from `CostModel`, so the table and the simulator never disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loadgen.sim.cost_model import BatchShape, CostModel


def decode_row(cm: CostModel, context: int) -> dict[str, float]:
    """One decode token of a lone request whose KV holds `context` tokens."""
    batch = BatchShape()
    batch.add(1, context)
    cost = cm.step(batch)
    kv_bytes = (context + 2) * cm.shape.kv_bytes_per_token
    attn_flops = (context + 1) * cm.shape.attention_flops_per_pair
    return {
        "context": context,
        "flops": cost.flops,
        "bytes_batch1": cost.bytes,
        "kv_bytes": kv_bytes,
        "intensity_batch1": cost.flops / cost.bytes,
        "attention_intensity": attn_flops / kv_bytes,
        "step_ms_batch1": cost.time * 1e3,
    }


def prefill_row(cm: CostModel, num_tokens: int) -> dict[str, float]:
    """One request prefilling `num_tokens` from an empty cache."""
    batch = BatchShape()
    batch.add(num_tokens, 0)
    cost = cm.step(batch)
    return {
        "tokens": num_tokens,
        "flops": cost.flops,
        "bytes": cost.bytes,
        "intensity": cost.flops / cost.bytes,
        "compute_bound": cost.compute_bound,
        "step_ms": cost.time * 1e3,
    }


def preemption_row(cm: CostModel, prompt_len: int, generated: int) -> dict[str, float]:
    """Swap (out and back in over the host link) versus recompute (one prefill of it all)."""
    tokens = prompt_len + generated
    batch = BatchShape()
    batch.add(tokens, 0)
    cost = cm.step(batch)
    dense = tokens * cm.shape.dense_flops_per_token / cm.hardware.peak_flops
    return {
        "prompt_len": prompt_len,
        "generated": generated,
        "kv_bytes": tokens * cm.shape.kv_bytes_per_token,
        "swap_ms": cm.swap_time(tokens) * 1e3,
        "recompute_ms": (max(cost.compute_time, cost.memory_time)) * 1e3,
        "recompute_dense_ms": dense * 1e3,
        "recompute_attention_ms": (cost.compute_time - dense) * 1e3,
    }


def roofline(
    cm: CostModel,
    contexts: Sequence[int] = (1024, 4096),
    prefill_lens: Sequence[int] = (512, 4096),
    preempt: tuple[int, int] = (4000, 100),
) -> dict[str, Any]:
    """The whole table as a JSON-ready dict."""
    s, hw = cm.shape, cm.hardware
    return {
        "model": {
            "name": s.name,
            "num_params": s.num_params,
            "dtype_bytes": s.dtype_bytes,
            "weight_bytes": s.weight_bytes,
            "kv_bytes_per_token": s.kv_bytes_per_token,
        },
        "hardware": hw.to_dict() | {"ridge_point": hw.ridge_point},
        # Decode reads every weight once per step, so a batch of B decodes has intensity
        # ~ B * 2 FLOPs / dtype_bytes per weight byte; it meets the ridge at this B.
        "decode_batch_at_ridge": hw.ridge_point
        * s.weight_bytes
        / (s.dense_flops_per_token + s.lm_head_flops),
        "decode": [decode_row(cm, t) for t in contexts],
        "prefill": [prefill_row(cm, n) for n in prefill_lens],
        "preemption": preemption_row(cm, *preempt),
    }


def _g(x: float) -> str:
    return f"{x:.3g}"


def format_roofline(table: dict[str, Any]) -> str:
    """A readable text rendering of `roofline()`."""
    m, hw, p = table["model"], table["hardware"], table["preemption"]
    lines = [
        f"model {m['name']}: {m['num_params'] / 1e9:.3g} B params, {m['dtype_bytes']} B/param, "
        f"weights {m['weight_bytes'] / 1e9:.3g} GB, KV {m['kv_bytes_per_token']} B/token",
        f"hardware {hw['name']}: {hw['peak_flops'] / 1e12:.4g} TFLOP/s, "
        f"{hw['memory_bandwidth'] / 1e9:.4g} GB/s, host {hw['host_bandwidth'] / 1e9:.3g} GB/s, "
        f"overhead {hw['step_overhead'] * 1e3:.3g} ms/step"
        + (f" + {hw['seq_overhead'] * 1e3:.3g} ms/request" if hw.get("seq_overhead") else "")
        + (
            f" + {hw['kv_token_overhead'] * 1e6:.3g} us/KV token"
            if hw.get("kv_token_overhead")
            else ""
        )
        + (
            f" + {hw['multi_token_overhead'] * 1e3:.3g} ms/multi-token step"
            if hw.get("multi_token_overhead")
            else ""
        ),
        f"ridge point: {hw['ridge_point']:.1f} FLOP/byte; decode batch to reach it: "
        f"{table['decode_batch_at_ridge']:.0f}",
        "",
        f"{'decode @ T':>12} {'FLOPs':>10} {'bytes (B=1)':>12} {'KV bytes':>10} "
        f"{'FLOP/B (B=1)':>13} {'attn FLOP/B':>12} {'ms (B=1)':>9}",
    ]
    for r in table["decode"]:
        lines.append(f"{r['context']:>12} {_g(r['flops']):>10} {_g(r['bytes_batch1']):>12} "
                     f"{_g(r['kv_bytes']):>10} {r['intensity_batch1']:>13.2f} "
                     f"{r['attention_intensity']:>12.2f} {r['step_ms_batch1']:>9.2f}")
    lines += [
        "",
        f"{'prefill N':>12} {'FLOPs':>10} {'bytes':>12} {'FLOP/B':>10} {'bound':>8} {'ms':>9}",
    ]
    for r in table["prefill"]:
        bound = "compute" if r["compute_bound"] else "memory"
        lines.append(f"{r['tokens']:>12} {_g(r['flops']):>10} {_g(r['bytes']):>12} "
                     f"{r['intensity']:>10.1f} {bound:>8} {r['step_ms']:>9.2f}")
    lines += [
        "",
        f"preempted request (prompt {p['prompt_len']} + {p['generated']} generated, "
        f"KV {p['kv_bytes'] / 1e6:.0f} MB):",
        f"  swap out + in : {p['swap_ms']:8.1f} ms",
        f"  recompute     : {p['recompute_ms']:8.1f} ms  (dense {p['recompute_dense_ms']:.1f} + "
        f"attention {p['recompute_attention_ms']:.1f})",
    ]
    return "\n".join(lines)
