"""Chat templates for the tiny tokenizers, written to match each family's real format.

Real checkpoints ship their own template; these exist so random-init models built
offline render prompts the way the real family does. A newline right after a Jinja tag
is dropped by the template engine, so newlines are written as `{{ '\\n' }}`.
"""


def _jinja_string(text: str) -> str:
    """`text` as a Jinja string literal (a newline as `\\n`, see the module docstring)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


def chatml_with_media(image: str, video: str | None = None, *, media_first: bool = False) -> str:
    """ChatML whose image (and video) parts render as the family's placeholder text.

    By default each part renders where it stands in the message (Qwen-VL, InternVL);
    `media_first` renders a message's images, then its videos, then its text (the
    LLaVA-OneVision checkpoints' template). The three ChatML families differ only here.
    """
    media = [("image", image)] + ([("video", video)] if video is not None else [])
    if media_first:
        body = "".join(
            f"{{% for part in message['content'] | selectattr('type', 'equalto', '{kind}') %}}"
            f"{{{{ {_jinja_string(text)} }}}}{{% endfor %}}" for kind, text in media)
        body = ("{% else %}" + body
                + "{% for part in message['content'] | selectattr('type', 'equalto', 'text') %}{{ part['text'] }}{% endfor %}"
                + "{% endif %}")
    else:
        body = ("{% else %}{% for part in message['content'] %}"
                "{% if part['type'] == 'text' %}{{ part['text'] }}"
                + "".join(f"{{% elif part['type'] == '{kind}' %}}{{{{ {_jinja_string(text)} }}}}" for kind, text in media)
                + "{% endif %}{% endfor %}{% endif %}")
    return ("{% for message in messages %}"
            "{{ '<|im_start|>' + message['role'] + '\\n' }}"
            "{% if message['content'] is string %}{{ message['content'] }}"
            + body
            + "{{ '<|im_end|>\\n' }}"
            "{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


# ChatML (Qwen2/2.5/3 text, and the base of the Qwen-VL templates).
CHATML = chatml_with_media("<|vision_start|><|image_pad|><|vision_end|>", "<|vision_start|><|video_pad|><|vision_end|>")
CHATML_SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>")

# Llama 3 header format.
LLAMA3 = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
LLAMA3_SPECIAL_TOKENS = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")

# Mistral v0.3 [INST] format: a system message is folded into the last user turn, and
# `[/INST]` follows the text with no space, as in the v0.3 tokenizer's template.
MISTRAL = (
    "{% set system = messages | selectattr('role', 'equalto', 'system') | list %}"
    "{{ bos_token }}"
    "{% for message in messages if message['role'] != 'system' %}"
    "{% set text = message['content'] if message['content'] is string else message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') %}"
    "{% if message['role'] == 'user' %}"
    "{% if loop.last and system %}{{ '[INST] ' + system[0]['content'] + '\\n\\n' + text + '[/INST]' }}"
    "{% else %}{{ '[INST] ' + text + '[/INST]' }}{% endif %}"
    "{% else %}{{ ' ' + text | trim + eos_token }}{% endif %}"
    "{% endfor %}"
)
MISTRAL_SPECIAL_TOKENS = ("[INST]", "[/INST]")

# Phi-3 format.
PHI3 = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
PHI3_SPECIAL_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")

# Gemma 3 turns (text and vision alike): the assistant's role is "model", a system
# message is prefixed to the first user turn, and an image part becomes
# `<start_of_image>`, which Gemma3Processor expands into the image's soft tokens.
GEMMA3 = (
    "{{ bos_token }}"
    "{% set system = messages | selectattr('role', 'equalto', 'system') | list %}"
    "{% set prefix = (system[0]['content'] if system[0]['content'] is string else system[0]['content'][0]['text']) + '\\n\\n' if system else '' %}"
    "{% for message in messages if message['role'] != 'system' %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' }}"
    "{% if loop.first %}{{ prefix }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
GEMMA3_SPECIAL_TOKENS = ("<start_of_turn>", "<end_of_turn>")
