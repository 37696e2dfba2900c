"""The checkpoint helpers' agreement: ``cfsdp._runtime.agree`` (one for the package)."""

from __future__ import annotations

from .._runtime.agree import RankFailed, agree

__all__ = ["RankFailed", "agree"]
