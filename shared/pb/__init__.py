"""Generated stubs of `protos/kvpark/v1/kvpark.proto` (do not edit: `python scripts/protogen.py`)."""

from . import kvpark_pb2, kvpark_pb2_grpc

__all__ = ["kvpark_pb2", "kvpark_pb2_grpc"]
