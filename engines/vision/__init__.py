"""Images in prompts (vision-language models): decoding and checking image bytes, the model's image processor and
its placeholder tokens, and the multimodal rotary positions and input embeddings a Qwen-VL forward needs. The
engine and the learner both call this room; nothing else knows what a pixel is."""
