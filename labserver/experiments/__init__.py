"""Experiments that join the rooms below: start servers, load them, keep and draw what happened.

- ``runs``: the one driver (``serve_and_load``, ``load_rates``, ``Runs``), for encoders and generation;
- ``compare``: the main job, ``labserver compare`` (``--task encode`` or ``generate``), and ``draw``;
- ``soak``: twice the capacity with faults, and the promises a server under overload must keep.
"""

from __future__ import annotations

from .runs import Runs, load_rates, machine_info, serve_and_load

__all__ = ["Runs", "load_rates", "machine_info", "serve_and_load"]
