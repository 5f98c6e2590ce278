"""Planning: what this FlashInfer release will allocate on this rank, and whether it fits.

``request`` turns a call's arguments into a typed request; ``facts`` reads the runtime
facts (granularities, torch's signal pad); ``rules`` mirrors each release's allocations
and produces the plan (``plan`` holds the types); ``headroom`` chooses the reserve on top;
``probe`` holds the plan on the device with ``cuMemCreate`` and releases it.
"""
