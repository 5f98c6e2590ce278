"""Activation: the master switch, the lazy bootstrap, and the wrappers' installation.

``gate`` reads the switch with the stdlib alone; ``bootstrap`` waits for ``import
flashinfer`` and registers the post-import hooks; ``patch`` installs and removes the
wrappers in every FlashInfer namespace that binds the two creation functions.
"""
