"""h2o-kv's C++ kernels for CPUs (h2o_kv/backends/native.py) against the eager torch operations they replace:
the head-pooled attention and eviction, a full layer's decode step, the prompt kernel with H2O's scores."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch

import h2o_kv
from h2o_kv.cache import attend as kernel
from h2o_kv.cache.routes import Call, Slots, attend

from helpers import slots


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize(
    "batch,heads,group,slots,dim",
    [(2, 3, 3, 40, 64), (1, 2, 1, 9, 16), (3, 4, 2, 67, 24), (2, 3, 2, 700, 128), (1, 5, 1, 300, 40)],
    ids=["gqa", "mha", "tail", "chunks", "empty-head"],
)
def test_pooled_kernel_equals_the_eager_path(batch, heads, group, slots, dim, softcap):
    """h2o-kv's C++ kernel for a head-pooled row (native.pooled_attend_one: each query head against its own
    head's slots only, the row read in chunks of 256 slots) gives attend_one's output, scores and last-query
    attention (every head x slot pair, the other heads' slots masked), with empty slots, heads holding
    different numbers of slots, and a head holding none."""
    from h2o_kv.backends import native

    gen = torch.Generator().manual_seed(slots)
    q = torch.randn(batch, heads * group, 1, dim, generator=gen)
    keys, values = torch.randn(2, batch, 1, slots, dim, generator=gen)
    tag = torch.randint(0, heads, (batch, 1, slots), generator=gen, dtype=torch.int8)
    tag[..., :heads] = torch.arange(heads, dtype=torch.int8)  # every head holds at least one slot,
    if heads == 5:  # but one: its query heads see nothing (output 0)
        tag[tag == 4] = 3
    pos = torch.randperm(slots, generator=gen).repeat(batch, 1, 1)
    pos[..., heads:][torch.rand(batch, 1, slots - heads, generator=gen) < 0.2] = -1
    got = native.pooled_attend_one(q, keys, values, tag, pos, heads, scaling=dim**-0.5, softcap=softcap)
    if heads == 5:  # the eager path has no answer for a head without slots (0 / 0); the others' are its own
        assert bool((got[0][:, :, 4 * group :] == 0).all())
        got, q, heads = (got[0][:, :, : 4 * group], *got[1:]), q[:, : 4 * group], 4
    query_head = torch.arange(heads).repeat_interleave(group).view(-1, group)
    expected = kernel.attend_one(q, keys, values, pos, scaling=dim**-0.5, softcap=softcap, want_scores=True,
                                 want_last=True, slot_head=tag, query_head=query_head)  # fmt: skip
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert float(got[1].masked_select(pos < 0).abs().sum()) == 0.0  # an empty slot gets no attention


@pytest.mark.parametrize("k", [1, 3])
def test_lowest_slots_equal_topk_then_sort(k):
    """native.lowest_slots (AdaKV's decode eviction): each row's k lowest priorities as slot indices in slot
    order, as torch's topk and sort give them, and a tie flagged exactly when a row's k-th and (k+1)-th lowest
    are equal (infinite ones included: masked slots)."""
    from h2o_kv.backends import native

    gen = torch.Generator().manual_seed(k)
    for trial in range(40):
        priority = torch.rand(3, 1, 50, generator=gen)
        if trial % 4 == 1:  # masked (empty) slots
            priority[torch.rand(priority.shape, generator=gen) < 0.3] = float("inf")
        if trial % 4 == 2:  # few distinct values: ties
            priority = (priority * 4).floor()
        if trial % 4 == 3:  # fewer than k + 1 finite priorities in a row
            priority[1, 0, k:] = float("inf")
        slots, tied = native.lowest_slots(priority, k)
        lowest = torch.topk(priority, k + 1, dim=-1, largest=False)
        assert tied == bool((lowest.values[..., -2] == lowest.values[..., -1]).any())
        if not tied:
            assert torch.equal(slots, lowest.indices[..., :k].sort(dim=-1).values)
    with pytest.raises(RuntimeError, match="S > k"):
        native.lowest_slots(torch.rand(1, 1, 3), 3)


def steady_state(batch, heads, slots, dim, seed, *, ties=False, within=False):
    """A full layer's storage before a steady decode step: distinct positions per row, some empty slots, one
    vacant (empty, score 0) slot per row for the new token; `ties`: scores on a few values; `within`: one
    sequence's rows within their capacity (an empty slot is freed instead of a token)."""
    gen = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(2, batch, heads, slots, dim, generator=gen)
    pos = torch.stack([torch.randperm(3 * slots, generator=gen)[:slots] for _ in range(batch * heads)])
    pos = pos.view(batch, heads, slots)
    score = torch.rand(batch, heads, slots, generator=gen)
    if ties:
        score = (score * 3).floor()
    pos[torch.rand(pos.shape, generator=gen) < 0.15] = -1
    vacant = torch.randint(0, slots, (batch, heads, 1), generator=gen)
    pos.scatter_(2, vacant, -1)
    score = score.masked_fill(pos < 0, 0.0)
    capacity = torch.full((batch, 1), slots // 2)
    if within:
        capacity[0] = slots
    next_pos = torch.full((batch, 1), 3 * slots)
    return keys, values, pos, score, vacant, capacity, next_pos


@pytest.mark.parametrize("storage", ["float32", "int8", "bfloat16"])
@pytest.mark.parametrize("dim", [16, 20], ids=["vectors", "tail"])
@pytest.mark.parametrize("case", ["plain", "ties", "within", "sinks"])
def test_decode_step_equals_the_eager_steady_step(case, dim, storage):
    """native.decode_step (a full uniform layer's decode step in one C++ pass per row) writes the new token
    into the vacant slot, attends, adds the scores and frees the oldest of the lowest priorities (score, the
    `recent` newest kept, and with `sinks` the positions below them; an empty slot first within capacity), exactly
    as the eager operations do (steady.Steady._decode_full with compile_kernel=False: scatter, attention, add,
    amin/argmin, scatter)."""
    from h2o_kv.backends import native
    from h2o_kv.cache.quant import quantize

    batch, heads, group, slots = 3, 2, 2, 24
    state = steady_state(batch, heads, slots, dim, seed=dim, ties=case == "ties", within=case == "within")
    keys, values, pos, score, vacant, capacity, qpos = state
    gen = torch.Generator().manual_seed(1)
    q = (
        torch.zeros(batch, heads * group, 1, dim)
        if case == "ties"
        else torch.randn(batch, heads * group, 1, dim, generator=gen)
    )
    new_keys, new_values = torch.randn(2, batch, heads, 1, dim, generator=gen)
    recent = torch.tensor([3, 5, 1]).view(batch, 1, 1)
    sinks = torch.tensor([30, 0, 45]).view(batch, 1, 1) if case == "sinks" else None
    key_scale = value_scale = new_scales = None
    int8 = storage == "int8"
    if storage == "bfloat16":
        keys, values, new_keys, new_values = (t.bfloat16() for t in (keys, values, new_keys, new_values))
    if int8:
        (keys, key_scale), (values, value_scale) = quantize(keys), quantize(values)
        (new_keys, new_values), new_scales = quantize(torch.stack((new_keys, new_values)))
    mine = [t.clone() if t is not None else None for t in (keys, values, pos, score, key_scale, value_scale)]
    out, freed = native.decode_step(q, mine[0], mine[1], mine[2], mine[3], None, vacant, new_keys, new_values, qpos,
                                    recent, capacity, scaling=0.3, key_scale=mine[4], value_scale=mine[5],
                                    new_scales=new_scales, sinks=sinks)  # fmt: skip
    # the eager step
    expand = vacant[..., None].expand(-1, -1, -1, dim)
    keys.scatter_(2, expand, new_keys)
    values.scatter_(2, expand, new_values)
    if int8:
        key_scale.scatter_(2, vacant, new_scales[0])
        value_scale.scatter_(2, vacant, new_scales[1])
    pos.scatter_(2, vacant, qpos.view(batch, 1, 1).expand(batch, heads, 1))
    expected, added, _ = native.attend_one(q, keys, values, pos, scaling=0.3, key_scale=key_scale,
                                           value_scale=value_scale)  # fmt: skip
    score += added
    valid = pos >= 0
    over = valid.sum(-1, keepdim=True) > capacity.view(-1, 1, 1)
    ranked = torch.where(pos >= qpos.view(-1, 1, 1) + 1 - recent, float("inf"), score)
    empty = torch.where(over, float("inf"), float("-inf"))
    ranked_sinks = ranked if sinks is None else ranked.masked_fill(pos < sinks, float("inf"))  # as `Sinks.priority`
    priority = torch.where(valid, ranked_sinks, empty)
    lowest = priority.amin(-1, keepdim=True)
    victim = torch.where(priority == lowest, pos, torch.iinfo(torch.int64).max).argmin(-1, keepdim=True)
    if sinks is not None:  # the sinks changed what some row frees
        plain = torch.where(valid, ranked, empty)
        plain_victim = torch.where(plain == plain.amin(-1, keepdim=True), pos, torch.iinfo(torch.int64).max)
        assert not torch.equal(plain_victim.argmin(-1, keepdim=True), victim)
    before = pos.clone()
    pos.scatter_(2, victim, -1)
    score.scatter_(2, victim, 0.0)
    torch.testing.assert_close(out, expected)
    assert torch.equal(freed, victim)
    for a, b in zip(mine, (keys, values, pos, score, key_scale, value_scale)):
        assert (a is None and b is None) or torch.equal(a, b)
    held = before.gather(2, freed)  # what each row freed: a token, or (within capacity) an empty slot
    assert bool((held[0] < 0).all()) == (case == "within") and bool((held[1:] >= 0).all())
    if case == "ties":  # rows with several lowest priorities: the oldest of them went
        assert bool(((priority == lowest).sum(-1) > 1).any())


@pytest.mark.parametrize("case", ["plain", "tie", "sinks"])
def test_pooled_decode_step_equals_the_eager_steady_step(case):
    """native.pooled_decode_step (AdaKV's steady step in one C++ call) writes the new token's heads into the
    vacant slots with their tags, attends (pooled_attend_one), adds the scores and frees each row's `heads`
    lowest priorities (lowest_slots; with `sinks`, positions below them kept), as the eager operations do; on a tie
    at the boundary it frees nothing."""
    from h2o_kv.backends import native

    batch, heads, group, slots, dim = 2, 3, 2, 40, 16
    gen = torch.Generator().manual_seed(3)
    keys, values = torch.randn(2, batch, 1, slots, dim, generator=gen)
    tag = torch.randint(0, heads, (batch, 1, slots), generator=gen, dtype=torch.int8)
    pos = torch.stack([torch.randperm(3 * slots, generator=gen)[:slots] for _ in range(batch)]).view(batch, 1, slots)
    score = torch.rand(batch, 1, slots, generator=gen)
    q = torch.randn(batch, heads * group, 1, dim, generator=gen)
    if case == "tie":
        score, q = (score * 2).floor(), torch.zeros_like(q)
    vacant = torch.stack([torch.randperm(slots, generator=gen)[:heads].sort().values for _ in range(batch)])
    vacant = vacant.view(batch, 1, heads)
    pos.scatter_(2, vacant, -1)
    score.scatter_(2, vacant, 0.0)
    new_keys, new_values = torch.randn(2, batch, 1, heads, dim, generator=gen)
    qpos, recent = torch.full((batch, 1), 3 * slots), torch.tensor([4, 2]).view(batch, 1, 1)
    sinks = torch.tensor([60, 20]).view(batch, 1, 1) if case == "sinks" else None
    mine = [t.clone() for t in (keys, values, tag, pos, score)]
    out, freed, tied = native.pooled_decode_step(q, *mine, None, vacant, new_keys, new_values, qpos, recent,
                                                 scaling=0.3, sinks=sinks)  # fmt: skip
    expand = vacant[..., None].expand(-1, -1, -1, dim)
    keys.scatter_(2, expand, new_keys)
    values.scatter_(2, expand, new_values)
    tag.scatter_(2, vacant, torch.arange(heads, dtype=torch.int8).expand(batch, 1, heads))
    pos.scatter_(2, vacant, qpos.view(batch, 1, 1).expand(batch, 1, heads))
    expected, added, _ = native.pooled_attend_one(q, keys, values, tag, pos, heads, scaling=0.3)
    score += added
    priority = torch.where((pos < 0) | (pos >= qpos.view(-1, 1, 1) + 1 - recent), float("inf"), score)
    if sinks is not None:
        plain = native.lowest_slots(priority, heads)[0]
        priority = priority.masked_fill(pos < sinks, float("inf"))
        assert not torch.equal(plain, native.lowest_slots(priority, heads)[0])  # the sinks changed what goes
    lowest, expected_tie = native.lowest_slots(priority, heads)
    assert tied == expected_tie == (case == "tie")
    if not tied:
        assert torch.equal(freed, lowest)
        pos.scatter_(2, lowest, -1)
        score.scatter_(2, lowest, 0.0)
    torch.testing.assert_close(out, expected)
    for a, b in zip(mine, (keys, values, tag, pos, score)):
        assert torch.equal(a, b)


def test_the_build_folder_is_named_by_the_sources_headers_and_flags(tmp_path, monkeypatch):
    """A header's change alone, or another flag, gives another build folder (torch's builder does not read the
    headers the sources include); the build compiles copies of the sources inside that folder, so two checkouts
    with the same kernels share one build: one unit that includes them (torch's headers parsed once)."""
    native = h2o_kv.backends.native
    header = tmp_path / "kernels.h"
    header.write_text("int f();\n")
    monkeypatch.setattr(native, "HEADERS", [header])
    before = native.build_folder()
    assert native.build_folder() == before
    header.write_text("int f(int);\n")
    changed = native.build_folder()
    assert changed != before
    monkeypatch.setattr(native, "flags", lambda: ["-O2"])
    assert native.build_folder() not in (before, changed)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(native, "_loaded", False)
    with mock.patch("torch.utils.cpp_extension.load") as build:
        native.load()
    folder = native.build_folder()
    assert build.call_args.kwargs["build_directory"] == str(folder)
    (unit,) = build.call_args.kwargs["sources"]
    assert unit == str(folder / "src" / "h2o_kv_kernels.cpp")
    lines = Path(unit).read_text().splitlines()
    assert lines == [f'#include "{path.name}"' for path in native.SOURCES]
    assert all((folder / "src" / path.name).read_bytes() == path.read_bytes() for path in native.SOURCES)
    assert (folder / "src" / "kernels.h").read_text() == "int f(int);\n"


@pytest.mark.parametrize(
    "batch,q_heads,kv_heads,new_from,n,holes",
    [
        (2, 6, 2, 0, 37, False),
        (1, 4, 4, 12, 300, True),
        (3, 8, 2, 5, 700, True),
        (2, 9, 3, 0, 1, False),
        (3, 6, 3, 0, 90, "padded"),
        (2, 4, 2, 9, 200, "padded"),
    ],
    ids=["prompt", "chunk-after-holes", "several-tiles", "one-query", "padded-prompt", "padded-chunk"],
)
@pytest.mark.parametrize("want", ["scores", "window+last", "output"])
def test_native_prompt_kernel_equals_the_blocked_path(batch, q_heads, kv_heads, new_from, n, holes, want):
    """native.prompt_attend (a prompt's attention with H2O's scores, tiles of queries per (sequence, KV head) in
    C++) gives the blocked torch path's output, scores and last-query attention: the causal triangle after
    `new_from` old slots, empty old slots masked, queries before `score_from` not scoring, tiles and parts that
    do not divide the prompt, a left-padded batch (padding queries at -1 see nothing)."""
    from h2o_kv.backends import native

    dim = 64 if n > 100 else 16
    keys, values, pos = slots(batch, kv_heads, new_from, n, 3, dim, torch.float32, seed=n)
    qpos = torch.arange(new_from, new_from + n).expand(batch, n).clone()
    if holes == "padded":  # row 1's first 7 tokens are padding: no position, slots empty
        qpos[1, :7] = -1
        qpos[1, 7:] -= 7 + new_from
        pos[1, :, : new_from + 7] = -1
        pos[1, :, new_from + 7 : new_from + n] = qpos[1, 7:]
    elif holes:  # old slots left empty (a chunk after evictions)
        pos[0, 0, 1] = pos[-1, -1, new_from - 1] = -1
    q = torch.randn(batch, q_heads, n, dim, generator=torch.Generator().manual_seed(2))
    call = Call(scaling=dim**-0.5, want_scores=want != "output", want_last=want == "window+last",
                score_from=n // 2 if want == "window+last" else 0, has_padding=holes == "padded",
                new_from=new_from)  # fmt: skip
    blocked = attend(q, Slots(keys, values, pos), qpos, call, native_kernels=False)
    with mock.patch.object(native, "prompt_attend", wraps=native.prompt_attend) as native_path:
        got = attend(q, Slots(keys, values, pos), qpos, call, native_kernels=True)
    takes_sdpa = want != "scores" and not holes  # no query before score_from scores: attend_prompt (SDPA)
    assert native_path.call_count == (1 if n > 1 and not takes_sdpa else 0)
    torch.testing.assert_close(got[0], blocked[0], atol=1e-5, rtol=1e-5)
    for mine, want_tensor in zip(got[1:], blocked[1:]):
        assert (mine is None) == (want_tensor is None)
        if mine is not None:
            torch.testing.assert_close(mine, want_tensor, atol=1e-4, rtol=1e-5)


def test_native_prompt_kernel_gives_a_sequence_the_same_numbers_alone_as_in_a_batch():
    """The kernel's work per sequence does not depend on the other rows (its split into tasks follows the prompt's
    shape): each row of a batch equals that row run alone, bit for bit (the engine's solo == batched)."""
    from h2o_kv.backends import native

    keys, values, pos = slots(3, 2, 4, 500, 0, 64, torch.float32, seed=5)
    q = torch.randn(3, 6, 500, 64, generator=torch.Generator().manual_seed(6))
    qpos = torch.arange(4, 504).expand(3, 500)
    options = dict(has_padding=False, new_from=4, scaling=0.125, want_scores=True, score_from=0, want_last=True)
    together = native.prompt_attend(q, keys, values, pos, qpos, **options)
    for row in range(3):
        alone = native.prompt_attend(q[row : row + 1], keys[row : row + 1], values[row : row + 1],
                                     pos[row : row + 1], qpos[row : row + 1], **options)  # fmt: skip
        for a, b in zip(alone, together):
            assert torch.equal(a[0], b[row])


def test_a_build_says_it_starts_beats_and_ends(capsys):
    """The lines a build (or a wait for another process's build) prints on stderr: a start, a heartbeat while it
    lasts, and the end with its time, in the caller's words."""
    import time

    err, deadline = "", time.monotonic() + 60  # until the first beat, however busy the machine
    with h2o_kv.backends.native._heartbeat("waiting for X", "waiting", "the other process finished", every=0.05):
        while "still" not in err and time.monotonic() < deadline:
            time.sleep(0.05)
            err += capsys.readouterr().err
    lines = (err + capsys.readouterr().err).splitlines()
    assert lines[0] == "h2o-kv: waiting for X"
    assert lines[1].startswith("h2o-kv: still waiting (")
    assert lines[-1].startswith("h2o-kv: the other process finished in ") and lines[-1].endswith(" s")
