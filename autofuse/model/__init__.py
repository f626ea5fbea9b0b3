"""The model path: ONNX import, fusion, tuning tasks, build and verification."""
