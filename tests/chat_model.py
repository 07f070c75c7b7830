"""A tiny random llama with a chat template, saved as transformers saves a Hugging Face folder: a byte-level BPE
tokenizer trained here on a few sentences (multi-byte characters among them: a random model writes broken UTF-8 too),
weights spread wide so that greedy tokens are not near ties. Text in, text out (test_generate_text.py) and the trained
model's hand-off (test_handoff.py) run on it."""
import torch

MESSAGE = "What is the capital of France?"
SENTENCES = ["What is the capital of France? The capital of France is Paris.", "Paris est une très belle ville, café crème.",
             "東京は日本の首都です。", "Ελλάδα και Αθήνα.", "The quick brown fox jumps over the lazy dog!"] * 4
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
EOS = [2, 0]  # <|im_end|>, <|endoftext|>: generation_config's eos as a list


def save_chat_model(folder, initializer_range: float = 0.5):
    """Write the folder; returns (its tokenizer, its model in eval mode). The default spread keeps greedy tokens far
    from ties; a quantized graph (w8a16) calibrates only on narrower activations."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(SENTENCES, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        chat_template=TEMPLATE)
    tokenizer.save_pretrained(folder)
    config = transformers.AutoConfig.for_model(
        "llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        initializer_range=initializer_range, tie_word_embeddings=False, bos_token_id=1, eos_token_id=EOS, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(folder)
    return tokenizer, model
