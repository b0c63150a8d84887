"""Test side of a two-rank trainer (:mod:`two_ranks`): kill every rank at once, mid-save.

:class:`TwoRankRun` is :class:`frameworks_common.KilledRun` whose SIGKILL reaches the
trainer's whole process group (both ranks at once, as a node failure would), and whose
references are per rank (``step-4-rank1``).
"""

from __future__ import annotations

import os
import signal
import subprocess

import gates
from frameworks_common import KilledRun, kill_while_writing


class ProcessGroupTrainer:
    """A trainer ``Popen`` (leader of its process group) whose ``send_signal`` reaches
    every process of the group, so :func:`kill_while_writing` kills all ranks."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process

    @property
    def returncode(self):
        return self.process.returncode

    def poll(self):
        return self.process.poll()

    def send_signal(self, sig: int) -> None:
        os.killpg(self.process.pid, sig)

    def wait(self, timeout: float):
        return self.process.wait(timeout)


class TwoRankRun(KilledRun):
    """:class:`KilledRun` of a two-rank trainer: the kill takes both ranks."""

    def kill_mid_save(self, steps: int) -> None:
        log = str(self.tmp_path / "train.log")
        trainer = gates.start_trainer(self.script, self._args(steps), self.daemon.socket, log)
        try:
            kill_while_writing(self.daemon, ProcessGroupTrainer(trainer), str(self.gates),
                               "durable4", "staged6", log, self.root)
        finally:
            if trainer.poll() is None:  # the test failed before its kill: take the ranks down
                os.killpg(trainer.pid, signal.SIGKILL)
                trainer.wait(30)

    def reference(self, name: str, rank: int = 0):
        """What rank ``rank`` recorded: ``step-N`` or ``resumed``."""
        return super().reference(f"{name}-rank{rank}")
