"""Audit: what a real creation asked the CUDA layer for, compared with its plan.

``intercept`` records the driver calls of FlashInfer's creation on this thread;
``compare`` checks them against the plan and keeps floors for later probes.
"""
