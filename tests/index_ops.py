"""Operations on a prefix index drawn by property tests (test_prefix_index.py, test_block_cache_model.py)."""

from __future__ import annotations


def apply_op(idx, chains, op, name, *args):
    """Apply one drawn operation (record, forget, resize, remove, add) to the index."""
    if op == "record":
        idx.record(name, chains[args[0]][: args[1]])
    elif op == "forget":
        return idx.forget(name, chains[args[0]][args[1]:])
    elif op == "resize":
        idx.resize_instance(name, args[0])
    elif op == "remove":
        idx.remove_instance(name)
    else:
        idx.add_instance(name, args[0])
