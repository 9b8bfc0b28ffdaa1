"""Chat templates of real model families, the parts that render tool calls and tool results.

No model hub is reachable from CI, so each template is written here from the family's public
template, keeping exactly what it writes around an assistant message's ``tool_calls`` and a tool
result (system prompts and tool listings are shortened). Where each came from:

- QWEN3: the ``chat_template`` of Qwen/Qwen3-8B's tokenizer_config.json (Qwen2.5-Instruct's writes
  the same text for calls and results; vLLM's examples/tool_chat_template_hermes.jinja likewise).
- QWEN3_CODER: Qwen/Qwen3-Coder-30B-A3B-Instruct's chat_template.jinja, as in vLLM's
  examples/tool_chat_template_qwen3coder.jinja.
- LLAMA3_JSON: meta-llama/Llama-3.1-8B-Instruct's template with JSON tool calls, as in vLLM's
  examples/tool_chat_template_llama3.1_json.jinja (one call per message; the template refuses more).
- MISTRAL: vLLM's examples/tool_chat_template_mistral_parallel.jinja (Mistral-7B-Instruct-v0.3's
  ``[TOOL_CALLS] [...]`` with 9-character call ids).
- DEEPSEEK_V3: deepseek-ai/DeepSeek-V3's template, as in vLLM's
  examples/tool_chat_template_deepseekv3.jinja.
- GPT_OSS: openai/gpt-oss-20b's chat_template.jinja (harmony), the assistant-call and tool-result
  branches (``<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>``).
"""

from __future__ import annotations

QWEN3 = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if (loop.first and message.content) or (not loop.first) %}{{- '\\n' }}{%- endif %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or (messages[loop.index0 - 1].role != 'tool') %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

QWEN3_CODER = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content is string and message.content | trim | length > 0 %}"
    "{{- '\\n' + message.content | trim + '\\n' }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
    "{%- for args_name, args_value in tool_call.arguments | items %}"
    "{{- '<parameter=' + args_name + '>\\n' }}"
    "{%- set args_value = args_value | tojson | safe if args_value is mapping or "
    "(args_value is sequence and args_value is not string) else args_value | string %}"
    "{{- args_value }}{{- '\\n</parameter>\\n' }}"
    "{%- endfor %}"
    "{{- '</function>\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + "
    "'\\n</tool_response>\\n<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

LLAMA3_JSON = (
    "{{- bos_token }}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nEnvironment: ipython<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' }}"
    "{{- message.content | trim }}{{- '<|eot_id|>' }}"
    "{%- elif 'tool_calls' in message %}"
    "{%- if message.tool_calls | length != 1 %}"
    "{{- raise_exception('This model only supports single tool-calls at once!') }}{%- endif %}"
    "{%- set tool_call = message.tool_calls[0].function %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{{- '{\"name\": \"' + tool_call.name | trim + '\", ' }}"
    "{{- '\"parameters\": ' }}{{- tool_call.arguments | tojson }}{{- '}' }}{{- '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}"
    "{{- {'output': message.content} | tojson }}{{- '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

MISTRAL = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}"
    "{{- '[INST] ' + message.content + '[/INST]' }}"
    "{%- elif message.tool_calls is defined %}"
    "{{- '[TOOL_CALLS] [' }}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- set out = tool_call.function | tojson %}"
    "{{- out[:-1] }}"
    "{%- if not tool_call.id is defined or tool_call.id | length < 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length >= 9!') }}"
    "{%- endif %}"
    "{{- ', \"id\": \"' + tool_call.id[-9:] + '\"}' }}"
    "{%- if not loop.last %}{{- ', ' }}{%- else %}{{- ']' + eos_token }}{%- endif %}"
    "{%- endfor %}"
    "{%- elif message.role == 'assistant' %}"
    "{{- ' ' + message.content + eos_token }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '[TOOL_RESULTS] {\"content\": ' + message.content | string + ', ' }}"
    "{{- '\"call_id\": \"' + message.tool_call_id[-9:] + '\"}[/TOOL_RESULTS]' }}"
    "{%- endif %}"
    "{%- endfor %}"
)

DEEPSEEK_V3 = (
    "{%- set ns = namespace(is_tool=false, is_first=false, is_output_first=true) %}"
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}"
    "{%- set ns.is_tool = false %}"
    "{{- '<｜User｜>' + message.content + '<｜Assistant｜>' }}"
    "{%- elif message.role == 'assistant' and message.tool_calls is defined %}"
    "{%- if ns.is_tool %}{{- '<｜tool▁outputs▁end｜>' }}{%- endif %}"
    "{%- set ns.is_first = false %}{%- set ns.is_tool = false %}"
    "{%- set ns.is_output_first = true %}"
    "{%- for tool in message.tool_calls %}"
    "{%- if not ns.is_first %}"
    "{{- (message.content or '') + '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool.type + "
    "'<｜tool▁sep｜>' + tool.function.name + '\\n```json\\n' + tool.function.arguments | tojson + "
    "'\\n```<｜tool▁call▁end｜>' }}"
    "{%- set ns.is_first = true %}"
    "{%- else %}"
    "{{- '\\n<｜tool▁call▁begin｜>' + tool.type + '<｜tool▁sep｜>' + tool.function.name + "
    "'\\n```json\\n' + tool.function.arguments | tojson + '\\n```<｜tool▁call▁end｜>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{{- '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- if ns.is_tool %}{{- '<｜tool▁outputs▁end｜>' }}{%- set ns.is_tool = false %}{%- endif %}"
    "{{- message.content + '<｜end▁of▁sentence｜>' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- set ns.is_tool = true %}"
    "{%- if ns.is_output_first %}"
    "{{- '<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message.content + '<｜tool▁output▁end｜>' }}"
    "{%- set ns.is_output_first = false %}"
    "{%- else %}"
    "{{- '\\n<｜tool▁output▁begin｜>' + message.content + '<｜tool▁output▁end｜>' }}"
    "{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if ns.is_tool %}{{- '<｜tool▁outputs▁end｜>' }}{%- endif %}"
)

GPT_OSS = (
    "{{- '<|start|>system<|message|>You are ChatGPT.\\n\\n# Valid channels: analysis, commentary, "
    "final.<|end|>' }}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{%- if message.tool_calls | length > 1 %}"
    "{{- raise_exception('multiple tool calls in one message are not supported') }}{%- endif %}"
    "{%- set tool_call = message.tool_calls[0] %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{%- if message.content %}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.content + '<|end|>' }}"
    "{%- endif %}"
    "{{- '<|start|>assistant to=functions.' + tool_call.name + '<|channel|>commentary json"
    "<|message|>' }}"
    "{{- tool_call.arguments | tojson }}{{- '<|call|>' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|start|>functions.' + message.name + ' to=assistant<|channel|>commentary<|message|>' }}"
    "{{- message.content | tojson }}{{- '<|end|>' }}"
    "{%- else %}"
    "{{- '<|start|>' + message.role + '<|message|>' + message.content + '<|end|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)
