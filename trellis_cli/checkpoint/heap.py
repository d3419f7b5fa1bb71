"""The collector while a command reads an opened checkpoint.

The opening builds ~5 million acyclic records with the cyclic collector paused (dialects/open.py `paused_gc`), so
they are all still young when it resumes: the first collections after it rescan every one of them, once per
generation, and find nothing (~0.9 s of validate at production size). `settled()` sets what is alive on entry
aside from the collector for the block (`gc.freeze`) and puts it back in the oldest generation after, where it
would have ended anyway: the rules' own garbage is still collected, and refcounting frees the records as ever.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def settled() -> Iterator[None]:
    if gc.get_freeze_count():  # someone froze the heap already: theirs to release, not ours
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def retire_young() -> None:
    """Hand every object now tracked to the oldest generation without scanning it: what a paused build leaves
    young (millions of records) would otherwise be rescanned by the first collections after it, to be found
    alive. Left alone where someone froze the heap (`gc.freeze`): their frozen set stays theirs."""
    if not gc.get_freeze_count():
        gc.freeze()  # (also resets the young generation's count)
        gc.unfreeze()  # the frozen objects go to the oldest generation
