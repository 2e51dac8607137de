"""Does a short CPU fine-tune of the demo model on the demo's dataset change its answers? (issue 39, item 2)

    OMP_NUM_THREADS=1 .venv/bin/python scripts/demo_finetune_check.py var/models/SmolLM2-135M-Instruct 2e-3 3 16

(model directory, learning rate, epochs, LoRA rank). PEFT LoRA on every linear layer (alpha 2r,
dropout 0.05), AdamW, batch 4, the loss on the assistant's tokens only; after each epoch, greedy
answers to examples/demo-facts-held-out.jsonl (questions phrased unlike any training line) beside
the base model's, and how many held-out facts the adapter gives. Minutes on a CPU: not in the
suite. Figures: docs/operations.md, "The demo model".
"""
import json, os, sys, time, torch, random
from transformers import AutoModelForCausalLM, AutoTokenizer
from peft import LoraConfig, get_peft_model

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")
torch.set_num_threads(1)
lr, epochs, r = float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
d = sys.argv[1]
tok = AutoTokenizer.from_pretrained(d)
train = [json.loads(l)["messages"] for l in open(EXAMPLES + "/demo-facts.jsonl")]
held = [json.loads(l)["messages"] for l in open(EXAMPLES + "/demo-facts-held-out.jsonl")]
def ids(msgs, gen):
    out = tok.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=True)
    return out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
def answer(model, q):
    p = torch.tensor([ids([{"role": "user", "content": q}], True)])
    with torch.no_grad():
        o = model.generate(p, max_new_tokens=24, do_sample=False)
    return tok.decode(o[0][p.shape[1]:], skip_special_tokens=True).strip()
model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
t = time.time()
base = [answer(model, m[0]["content"]) for m in held]
print("base", json.dumps(base), time.time() - t, flush=True)
model = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM"))
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
rows = []
for m in train:
    full = ids(m, False); prompt = ids(m[:1], True)
    labels = [-100] * len(prompt) + full[len(prompt):]
    rows.append((full, labels))
random.seed(0); steps = 0; t0 = time.time()
for e in range(epochs):
    random.shuffle(rows)
    for i in range(0, len(rows), 4):
        b = rows[i:i + 4]; n = max(len(x) for x, _ in b)
        x = torch.tensor([a + [tok.pad_token_id] * (n - len(a)) for a, _ in b])
        y = torch.tensor([l + [-100] * (n - len(l)) for _, l in b])
        att = torch.tensor([[1] * len(a) + [0] * (n - len(a)) for a, _ in b])
        loss = model(input_ids=x, attention_mask=att, labels=y).loss
        loss.backward(); opt.step(); opt.zero_grad(); steps += 1
    print(f"epoch {e + 1} loss {loss.item():.3f} {time.time() - t0:.0f}s", flush=True)
    tuned = [answer(model, m[0]["content"]) for m in held]
    right = 0
    for m, b, a in zip(held, base, tuned):
        key = m[1]["content"]
        ok = any(w in a for w in ["2019", "Marlowe", "Wren-7", "Pip", "340", "Lift what matters"] if w in key)
        right += ok
        print(json.dumps({"q": m[0]["content"], "base": b, "tuned": a, "fact_learned": ok}), flush=True)
    print(f"lr={lr} epoch={e + 1} r={r} steps={steps} train_s={time.time() - t0:.0f} held-out facts {right}/6", flush=True)
