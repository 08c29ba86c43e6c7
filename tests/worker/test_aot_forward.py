"""`worker.model.aot_forward`: packages built once per shape of model, loaded over the live
module's own tensors, dispatched by token count; the default model's packages are built and
swapped in by a live server in tests/service/test_live_compiled.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from worker.model.aot_forward import AotForward, token_ranges
from worker.model.compiled_forward import compiler_missing

ATTEND = torch.ops.aten.tanh.default  # stands for the C++ attention op: an op a package can call


class Tiny(nn.Module):
    def __init__(self, rows: int = 16, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.table = nn.Parameter(torch.randn(rows, 8, generator=generator), requires_grad=False)
        self.register_buffer("scale", torch.full((8,), 0.5))

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, attention: object) -> torch.Tensor:
        x = self.table[ids] * self.scale + positions[:, None].float()
        return attention(x) * 2  # type: ignore[operator]


def _inputs(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(tokens) % 16, torch.arange(tokens)


def test_token_ranges_cover_every_width_once() -> None:
    assert token_ranges(2048, None) == [(1, 1), (2, 2048)]
    assert token_ranges(2048, 64) == [(1, 1), (2, 64), (65, 2048)]
    assert token_ranges(2048, 4096) == [(1, 1), (2, 2048)]  # a cut-over above every step
    assert token_ranges(1, None) == [(1, 1)]


def test_the_key_follows_shapes_not_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPSERVE_AOT_CACHE", str(tmp_path))
    ranges = [(1, 1), (2, 8)]
    key = AotForward(Tiny(seed=0), ATTEND, ranges).spec.key
    assert AotForward(Tiny(seed=1), ATTEND, ranges).spec.key == key  # other weights, same code
    assert AotForward(Tiny(rows=32), ATTEND, ranges).spec.key != key
    assert AotForward(Tiny(), ATTEND, [(1, 1), (2, 16)]).spec.key != key
    assert AotForward(Tiny(), torch.ops.aten.sigmoid.default, ranges).spec.key != key
    assert AotForward(Tiny(), ATTEND, ranges).directory == tmp_path / key


@pytest.mark.skipif(compiler_missing() is not None, reason="no C++ compiler")
def test_built_packages_run_the_live_tensors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPSERVE_AOT_CACHE", str(tmp_path))
    model = Tiny()
    aot = AotForward(model, ATTEND, [(1, 1), (2, 8)])
    assert not aot.built()
    aot.build()
    assert aot.built()
    assert sorted(p.name for p in aot.directory.iterdir()) == ["spec.json", "tokens-1-1.pt2", "tokens-2-8.pt2"]
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]  # the temporary build is gone
    # a second module of the same shape (another worker, a restart) loads the same packages
    other = Tiny(seed=3)
    forward = AotForward(other, ATTEND, [(1, 1), (2, 8)]).load()
    with torch.inference_mode():
        for tokens in (1, 2, 5, 8, 9):  # 9: past every range, so the eager forward runs
            torch.testing.assert_close(forward(*_inputs(tokens), ATTEND), other(*_inputs(tokens), ATTEND))
        before = forward(*_inputs(3), ATTEND).clone()
        other.table.mul_(3)  # the package holds the module's tensors themselves, not copies
        after = forward(*_inputs(3), ATTEND)
    assert not torch.equal(before, after)
    torch.testing.assert_close(after, other(*_inputs(3), ATTEND))


@pytest.mark.skipif(compiler_missing() is not None, reason="no C++ compiler")
def test_a_damaged_package_fails_to_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPSERVE_AOT_CACHE", str(tmp_path))
    aot = AotForward(Tiny(), ATTEND, [(1, 1)])
    aot.directory.mkdir(parents=True)
    (aot.directory / "tokens-1-1.pt2").write_bytes(b"not a package")
    assert aot.built()
    with pytest.raises(Exception):  # noqa: B017  torch raises RuntimeError from its C++ loader
        aot.load()
