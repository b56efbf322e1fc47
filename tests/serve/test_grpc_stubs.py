"""The generated stubs are importable (built from protos/ at install); a clear skip reason if not."""
from serve_helpers import STUBS_ERROR

import pytest


def test_stubs_are_built():
    if STUBS_ERROR:
        pytest.skip(f"gRPC stubs not built: {STUBS_ERROR}")
    from ftjax.serve.stubs import SERVICE_NAME, load

    pb, pb_grpc = load()
    assert pb.DESCRIPTOR.services_by_name["InferenceService"].full_name == SERVICE_NAME
    assert hasattr(pb_grpc, "InferenceServiceStub")
