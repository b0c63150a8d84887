"""Which buffers the daemon copies from CUDA IPC and which the trainer copies (mixed
transport), decided from plain facts so that it is testable without a GPU."""

from ckpt_client.transport.cuda_routing import IPC, SHM, BufferFacts, route

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


def test_yama_scope_1_lets_the_daemon_in_by_naming_it_our_ptracer():
    from ckpt_client.transport.cuda_routing import _yama_verdict

    asked = []

    def allow(pid):
        asked.append(pid)
        return None

    assert _yama_verdict(0, 4242, allow) is None and asked == [], "no Yama rule to lift"
    assert _yama_verdict(1, 4242, allow) is None and asked == [4242]
    refused = _yama_verdict(1, 4242, lambda pid: "Operation not permitted")
    assert "ptrace_scope=1" in refused and "Operation not permitted" in refused
    for scope in (2, 3):  # administrators only / nobody: a ptracer cannot be named
        reason = _yama_verdict(scope, 4242, allow)
        assert f"ptrace_scope={scope}" in reason and "expandable segments off" in reason
    assert asked == [4242]
    assert "ptrace_scope=1" in _yama_verdict(1, None, allow), "no daemon pid: nothing to name"


def test_naming_a_ptracer_works_where_yama_is_and_says_why_where_it_is_not():
    import os

    from ckpt_client.transport.cuda_routing import allow_ptracer

    outcome = allow_ptracer(os.getppid())
    if os.path.exists("/proc/sys/kernel/yama/ptrace_scope"):
        assert outcome is None
    else:  # the kernel has no Yama: prctl refuses the unknown option
        assert outcome == os.strerror(22)
