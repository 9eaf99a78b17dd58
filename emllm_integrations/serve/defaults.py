"""Defaults of `emllm serve` that the command line's help and the server's modules both read, in a module that
imports nothing: the package's ``__init__`` (the command line) must stay light, and the server's modules must not
import the package that imports them."""

STORE_TIMEOUT_S = 300.0
"""How long one call to a remote session store (a listing, one file's upload or download, a whole restore's
download) may take before the turn waiting on it fails: long enough for a 128K-token session's gigabyte of KV over a
slow link, short enough that a store which stopped answering does not hold a session for ever."""
