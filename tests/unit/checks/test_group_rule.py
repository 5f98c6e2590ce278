"""Mode 1: the group check's two halves. The arguments against the rank set (every
release, pure), and the group FlashInfer rendezvouses on (allocator C), read from a real
one-rank gloo group made in this process on a ``HashStore`` (no other process)."""

from __future__ import annotations

import pytest

from flashinfer_safe_workspace import _reasons as R, checks
from flashinfer_safe_workspace.checks import group
from unit.facts import ctx, no_group


def outcome(c):
    res = checks.run_one(group, c)
    return (res.code, res.value) if res.applies else "off"


def test_mode1_no_process_group_is_not_checked():
    assert outcome(no_group(world=3, rank=5)) == "off"


ARGS = [  # (world_size, rank, group size, my position) -> outcome, without a torch group
    (2, 0, 2, 0, (R.OK, "ranks=2")),
    (4, 0, 2, 0, (R.ARG_MISMATCH, "ranks=2")),
    (2, 1, 2, 0, (R.ARG_MISMATCH, "ranks=2")),
    ("2", 5, 2, 5, (R.OK, "ranks=2")),  # a world_size FlashInfer rejects itself: not ours
    (2, "x", 2, 0, (R.OK, "ranks=2")),
]


@pytest.mark.parametrize("world,rank,size,me,expected", ARGS)
def test_mode1_arguments_against_the_rank_set(world, rank, size, me, expected):
    assert outcome(ctx("trtllm", "0.7.4", world=world, rank=rank, size=size, me=me)) == expected


def test_mode1_argument_notes():
    c = ctx("trtllm", "0.7.4", world=4, rank=0, size=2, label="tp")
    assert checks.run_one(group, c).note == (
        "world_size=4 but the group FlashInfer will use (tp) has 2 ranks [0, 1]")
    c = ctx("trtllm", "0.7.4", world=2, rank=1, size=2, me=0, label="tp")
    assert checks.run_one(group, c).note == "rank=1 but this process is rank 0 of tp"


class TorchDistBackend:  # the name FlashInfer's comm backend class carries
    pass


RENDEZVOUS = [  # (version, backend, entry, symm, cc, bound) -> FlashInfer's group, or None
    ("0.6.10", "trtllm", "unified", False, False, {}, ("WORLD", None)),
    ("0.6.14", "trtllm", "unified", False, False, {"group": "G"}, ("group", "G")),
    ("0.6.10", "mnnvl", "unified", False, False, {"group": "G"}, ("WORLD", None)),
    ("0.6.10", "mnnvl", "unified", False, False, {"comm_backend": TorchDistBackend()}, None),
    ("0.6.10", "mnnvl", "unified", False, False, {"comm_backend": object()}, ("WORLD", None)),
    ("0.6.10", "auto", "unified", False, False, {"group": "G"}, ("group", "G")),
    ("0.7.2", "trtllm", "legacy", False, False, {}, ("WORLD", None)),  # legacy non-symm: C
    ("0.7.2", "trtllm", "legacy", True, False, {}, None),  # symm: B3
    ("0.6.16", "trtllm", "unified", False, True, {"group": "G"}, ("group", "G")),  # CC: C
    ("0.6.16", "trtllm", "unified", False, False, {}, None),
    ("0.6.15", "trtllm", "unified", False, True, {}, None),
    ("0.7.4", "trtllm", "unified", False, False, {}, None),
]


@pytest.mark.parametrize("version,backend,entry,symm,cc,bound,expected", RENDEZVOUS)
def test_mode1_which_group_flashinfer_rendezvouses_on(version, backend, entry, symm, cc,
                                                       bound, expected):
    c = ctx(backend, version, entry=entry, symm=symm, cc=cc, bound=bound)
    assert group._rendezvous_group(c) == expected


@pytest.fixture
def world_of_one():
    """A real default group of one rank in this process (gloo on an in-memory HashStore),
    destroyed after the test."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


def test_mode1_rendezvous_on_world_of_another_size_is_vetoed(world_of_one):
    c = ctx("trtllm", "0.6.10", world=2, rank=0, size=2, label="tp")
    res = checks.run_one(group, c)
    assert (res.ok, res.code, res.value) == (False, R.RENDEZVOUS_GROUP,
                                             "rendezvous=WORLD size=1 world_size=2")
    assert res.note == ("FlashInfer 0.6.10 rendezvouses on WORLD (1 ranks, this rank 0) while "
                        "the call is for 2 ranks [0, 1]: it would wait for ranks that never come")
    # the same call on a release that does not rendezvous on WORLD
    assert outcome(ctx("trtllm", "0.7.4", world=2, rank=0, size=2)) == (R.OK, "ranks=2")


def test_mode1_rendezvous_on_the_calls_own_group_passes(world_of_one):
    c = ctx("trtllm", "0.6.10", world=1, rank=0, size=1)
    assert outcome(c) == (R.OK, "rendezvous=WORLD size=1 world_size=1")


def test_mode1_rendezvous_rank_differs(world_of_one):
    """The call's rank agrees with its rank set but not with FlashInfer's group."""
    from unit.facts import replace

    c = ctx("trtllm", "0.6.10", world=1, rank=1, size=1, me=1)
    c = replace(c, members=replace(c.members, ranks=(0,)))
    res = checks.run_one(group, c)
    assert (res.code, res.value) == (R.RENDEZVOUS_GROUP, "rendezvous=WORLD size=1 world_size=1")
    assert "(1 ranks, this rank 0)" in res.note


def test_mode1_rendezvous_needs_an_initialised_group():
    c = ctx("trtllm", "0.6.10", world=2, rank=0, size=2)
    assert outcome(c) == (R.OK, "ranks=2")


def test_mode1_no_process_group_has_nothing_to_mismatch():
    """``group_mismatch`` on its own: without a process group there is no rank set to hold
    the call's ``world_size``/``rank`` against, whatever they say."""
    c = no_group(world=3, rank=5)
    assert group.group_mismatch(c.req, c.members) == ""
    c = ctx("trtllm", "0.7.4", world=3, rank=0, size=2)
    assert group.group_mismatch(c.req, c.members).startswith("world_size=3 but")
