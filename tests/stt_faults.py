"""A fault only a GPU makes, for the STT's child process: from the moment a flag file exists, every model step
raises as a CUDA context broken for good does. Module level: a spawned child imports it by name."""

from __future__ import annotations

import os
from typing import Any

FAULT_FLAG_ENV = "KAME_TEST_STT_FAULT_FLAG"  # the flag file's path, inherited by the spawned child


def failing_steps_child_main(*args: Any) -> None:
    from knowledge import stt_process
    from knowledge.stt_kyutai import KyutaiSttEngine

    real = KyutaiSttEngine._model_step
    flag = os.environ[FAULT_FLAG_ENV]

    def step(self: KyutaiSttEngine, *a: Any) -> Any:
        if os.path.exists(flag):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(self, *a)

    KyutaiSttEngine._model_step = step  # type: ignore[method-assign]
    stt_process._child_main(*args)
