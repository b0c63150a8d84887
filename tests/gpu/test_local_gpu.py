"""Local checkpoints of CUDA state dicts (the reference's BasicTensorAwareStateDict case).

Skipped on machines without CUDA; run on an accelerator machine.
"""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from ckpt_client import BasicTensorAwareStateDict, LocalCheckpointManager  # noqa: E402


def test_cuda_state_dict_saves_locally_and_loads_back(start_daemon, tmp_path):
    local_dir = tmp_path / "node"
    daemon = start_daemon(extra_args=["--local-dir", str(local_dir)])
    manager = LocalCheckpointManager(local_dir / "ckpt", session_id="gpu", socket=daemon.socket)
    g = torch.Generator(device="cuda").manual_seed(3)
    state = {"w": torch.randn(512, 512, device="cuda", generator=g),
             "h": torch.randn(64, device="cuda", generator=g).bfloat16(), "step": 3}
    expected = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    manager.save(BasicTensorAwareStateDict(state), 3)
    state["w"].zero_()  # after save returned: must not reach the checkpoint
    assert manager.find_latest() == 3
    loaded, part_id = manager.load()
    assert part_id == (3, 0, "gpu")
    assert torch.equal(loaded.state_dict["w"], expected["w"])
    assert torch.equal(loaded.state_dict["h"], expected["h"])
    assert loaded.state_dict["step"] == 3
