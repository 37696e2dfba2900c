"""cfsdp: torch FSDP with its hot paths in C. Placeholder during bring-up."""
from ._core import backend
