"""The seed examples' Triton configs, as written and as Triton's protobuf printer writes them back."""

SEED_RESNET50 = """
name: "resnet50"
platform: "graph_executor"
max_batch_size: 32
input [ { name: "input" data_type: TYPE_FP32 format: FORMAT_NCHW dims: [3, 224, 224] } ]
output [ { name: "output" data_type: TYPE_FP32 dims: [1000] } ]
parameters [
  { key: "EXECUTOR_TYPE" value: { string_value: "graph" } },
  { key: "DEVICE_ID" value: { string_value: "0" } }
]
dynamic_batching { preferred_batch_size: [4, 8, 16] max_queue_delay_microseconds: 5000 }
"""

SEED_BERT = """
name: "bert"
platform: "graph_executor"
max_batch_size: 16
input [
  { name: "input_ids" data_type: TYPE_INT32 dims: [128] },
  { name: "attention_mask" data_type: TYPE_INT32 dims: [128] }
]
output [ { name: "pooled_output" data_type: TYPE_FP32 dims: [768] } ]
dynamic_batching { preferred_batch_size: [4, 8] max_queue_delay_microseconds: 5000 }
"""

SEED_ENSEMBLE = """
name: "preprocess_resnet_postprocess"
platform: "ensemble"
input [ { name: "raw_image" data_type: TYPE_UINT8 dims: [-1] } ]
output [ { name: "predictions" data_type: TYPE_FP32 dims: [5] } ]
step [ { model_name: "preprocess" model_version: 1
         input_map { key: "input" value: "raw_image" } output_map { key: "output" value: "preprocessed_image" } } ]
step [ { model_name: "resnet50" model_version: 1
         input_map { key: "input" value: "preprocessed_image" } output_map { key: "output" value: "logits" } } ]
step [ { model_name: "postprocess" model_version: 1
         input_map { key: "input" value: "logits" } output_map { key: "output" value: "predictions" } } ]
"""

SEED_RESNET50_AS_PRINTED = """name: resnet50
platform: graph_executor
max_batch_size: 32
input [ { name: input data_type: TYPE_FP32 format: FORMAT_NCHW dims: [3, 224, 224] } ]
output [ { name: output data_type: TYPE_FP32 dims: [1000] } ]
# GE 后端配置
parameters [ { key: EXECUTOR_TYPE value: { string_value: graph } }, { key: DEVICE_ID value: { string_value: 0 } } ]
dynamic_batching { preferred_batch_size: [4, 8, 16] max_queue_delay_microseconds: 5000 }
"""

SEED_ENSEMBLE_AS_PRINTED = """name: preprocess_resnet_postprocess
platform: ensemble
step [ { model_name: preprocess model_version: 1 input_map { key: input value: raw_image } output_map { key: output value: preprocessed_image } } ]
step [ { model_name: resnet50 model_version: 1 input_map { key: input value: preprocessed_image } output_map { key: output value: logits } } ]
step [ { model_name: postprocess model_version: 1 input_map { key: input value: logits } output_map { key: output value: predictions } } ]
"""
