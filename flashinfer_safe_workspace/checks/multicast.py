"""Modes 3 and 4: NVLink multicast and confidential computing, on every rank.

A path that creates a multicast object needs ``CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED``
and no confidential computing (the driver disables ``cuMulticast*`` there) on every rank:
0.6.10–0.6.14 return an mnnvl workspace with a null multicast pointer (a crash later);
other releases raise, on some ranks only when the ranks differ. Vetoed before any
multicast call. From 0.6.16 the trtllm workspace switches allocator under confidential
computing, so the ranks must agree on it."""

from __future__ import annotations

from .. import _reasons as R
from .base import by_field, differ, fail, ok

NAME = "multicast"
CODE = R.NO_MULTICAST
MODES = (3, 4)
RELEASES = ("multicast: mnnvl (every release), mnnvl-cutedsl, auto before 0.6.16; "
            "agreement on confidential computing: 0.6.16+")


def applies(ctx) -> bool:
    return ctx.makes_multicast or bool(ctx.traits is not None and ctx.traits.confidential_compute)


def local(ctx):
    mc = ctx.facts().multicast
    value = f"multicast={int(mc)} cc={int(ctx.cc)}"
    if ctx.makes_multicast and ctx.cc:
        return fail(R.CONFIDENTIAL_COMPUTE, value,
                    f"confidential computing disables NVLink multicast; backend={ctx.backend} "
                    "creates a multicast object (use trtllm)")
    if ctx.makes_multicast and not mc:
        return fail(R.NO_MULTICAST, value,
                    f"this GPU reports no NVLink multicast; backend={ctx.backend} creates a "
                    "multicast object (use trtllm)")
    return ok(value)


def compare(records):
    return differ(records, NAME, by_field("cc"), R.CONFIDENTIAL_COMPUTE,
                  "ranks disagree on confidential computing (FlashInfer would pick different "
                  "allocators)")
