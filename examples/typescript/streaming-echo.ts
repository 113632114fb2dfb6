/**
 * A streaming echo "model": the worker answers token by token with `ctx.progress`,
 * the caller prints each token as it comes, then the whole answer.
 *
 *     TURND_URL=ws://127.0.0.1:7420/v1 node streaming-echo.js worker &
 *     node streaming-echo.js ask "the quick brown fox"
 *
 * Progress is not durable: a caller that connects late reads the last token in
 * `(await client.get(turnId)).progress`, and the answer is the turn's `output`. Put
 * a real model's token stream in `generate()`.
 */
import { connect, isProgress, isProgressDropped, Worker } from "turnd";

// One URL, or a cluster's nodes' URLs separated by commas.
const url = (process.env.TURND_URL ?? "ws://127.0.0.1:7420/v1").split(",").map((u) => u.trim());
const token = process.env.TURND_TOKEN;
const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

/** The "model": echoes the prompt word by word. */
async function* generate(prompt: string, delayMs: number): AsyncGenerator<string> {
  await sleep(delayMs * 4); // time to the first token
  const words = prompt.split(/\s+/).filter(Boolean);
  for (const [n, word] of words.entries()) {
    await sleep(delayMs);
    yield n === 0 ? word : ` ${word}`;
  }
}

async function serve(): Promise<void> {
  const worker = new Worker({ url, token, workerId: process.env.WORKER_ID ?? "echo-model-1" });
  worker.function("echo.model", { concurrency: 16, timeoutMs: 60_000 }, async (ctx, input: { prompt: string }) => {
    let text = "";
    for await (const t of generate(input.prompt, 50)) {
      ctx.progress({ token: t }); // returns at once; never throws for the daemon
      text += t;
    }
    return { text };
  });
  worker.on("state", (state: string) => console.error(`[worker] ${state}`));
  await worker.run(); // until SIGTERM/SIGINT, then drain
}

async function ask(prompt: string): Promise<void> {
  const client = await connect({ url, token });
  try {
    const { turnId } = await client.submit(process.env.SESSION_ID ?? "echo-1", "echo.model", { prompt });
    for await (const item of await client.stream(turnId)) {
      // The stream ends with the turn.
      if (isProgress(item)) process.stdout.write((item.data as { token: string }).token);
      else if (isProgressDropped(item)) process.stdout.write(`[${item.count} tokens lost]`);
    }
    const turn = await client.get(turnId);
    if (turn.status !== "completed") throw new Error(`turn ${turn.status}`);
    console.log(`\nanswer: ${(turn.output as { text: string }).text}`);
  } finally {
    await client.close();
  }
}

if (process.argv[2] === "worker") await serve();
else await ask(process.argv[3] ?? "hello world");
