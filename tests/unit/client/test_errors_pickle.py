"""The client's errors survive pickling with their message and attributes.

DCP gathers a rank's exception to the coordinator and its process executor sends it
back to the trainer, both pickled: an error whose constructor does not take its own
message would come back as a ``TypeError`` about ``__init__`` instead of the text that
says what to do.
"""

from __future__ import annotations

import pickle

import pytest

from ckpt_client.errors import (CheckpointException, DaemonNotAnsweringError, DaemonReplyError,
                                DaemonRequestError, DaemonUnavailableError,
                                StagingTimeoutError)

ERRORS = [
    DaemonUnavailableError("/run/ckptd.sock", "no daemon answers"),
    DaemonNotAnsweringError("/run/ckptd.sock", "hello unanswered", 1234),
    DaemonReplyError("/run/ckptd.sock", "field 'x' missing"),
    StagingTimeoutError("/run/ckptd.sock", "3 earlier zero-stall saves not staged"),
    DaemonRequestError({"code": "PATH_OUTSIDE_ROOTS", "message": "/x is outside the allowed "
                        "roots", "hint": "save under --root"}),
    CheckpointException("staging failed", {1: "rank 1: ENOSPC"}),
]


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_an_error_pickles_back_to_itself(error):
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error)
    assert vars(copy) == vars(error)
