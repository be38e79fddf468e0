"""Pooling models (sequence classifiers, reward models): what they return and how a step pools.

outputs.py: vLLM's output objects (PoolingRequestOutput, ClassificationRequestOutput) and the
classify activation; pool_rows.py: the step rows whose score-head logits are kept; prefix_order.py:
the order that lets prompts sharing a prefix share its KV through the prefix cache.
"""
