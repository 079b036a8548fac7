"""TensorFlow's checkpoint protos (TF's field numbers, package `checkpoint.tensorflow`); see README.

>>> from checkpoint.protos import tensor_bundle_pb2
>>> tensor_bundle_pb2.BundleHeaderProto(num_shards=1).num_shards
1
"""
