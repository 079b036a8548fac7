"""TensorFlow's checkpoint protos (TF's field numbers, package `checkpoint.tensorflow`); see README."""
