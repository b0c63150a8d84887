"""Which buffers the daemon copies from CUDA IPC and which the trainer copies (mixed
transport), decided from plain facts so that it is testable without a GPU."""

from ckpt_client.cuda_export import IPC, SHM, BufferFacts, route

GPU0, GPU1 = "GPU-aaaa", "GPU-bbbb"


def test_cuda_tensors_the_daemon_sees_go_by_ipc_and_the_rest_by_shm():
    buffers = [BufferFacts(True, GPU0, 1024), BufferFacts(False, None, 8),  # an Adam step
               BufferFacts(False, None, 0),                                  # BytesIO item
               BufferFacts(True, GPU0, 0),                                   # zero-size
               BufferFacts(True, GPU1, 4096),                                # daemon blind
               BufferFacts(True, GPU0, 4096, contiguous=False)]              # a transpose
    routes, notes = route(buffers, {GPU0}, blocked=None)
    assert routes == [IPC, SHM, SHM, SHM, SHM, SHM]
    assert len(notes) == 1 and GPU1 in notes[0] and "CUDA_VISIBLE_DEVICES" in notes[0]


def test_without_a_daemon_gpu_or_with_ipc_blocked_everything_goes_by_shm():
    buffers = [BufferFacts(True, GPU0, 1024)]
    assert route(buffers, None, blocked=None) == ([SHM], [])
    routes, notes = route(buffers, {GPU0}, blocked="Yama ptrace_scope=1 denies pidfd_getfd")
    assert routes == [SHM] and "ptrace_scope" in notes[0]
