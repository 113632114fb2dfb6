/**
 * An approval step: the worker plans a deployment, then suspends the turn to ask a
 * person before it acts; the caller answers by resuming the turn.
 *
 *     TURND_URL=ws://127.0.0.1:7420/v1 node approval.js worker &
 *     node approval.js request billing          # prints the turn id and the question
 *     node approval.js answer TURN_ID yes       # resumes it; prints what was done
 *
 * While it waits, the turn holds its session (later messages queue behind it) but no
 * worker: the worker's slot is free, and the wait survives restarts of the daemon and
 * of the worker. `(await client.get(turnId)).inputRequest` shows the question.
 */
import { connect, isEvent, resumed, Suspend, Worker } from "turnd";

// One URL, or a cluster's nodes' URLs separated by commas.
const url = (process.env.TURND_URL ?? "ws://127.0.0.1:7420/v1").split(",").map((u) => u.trim());
const token = process.env.TURND_TOKEN;

interface Plan {
  service: string;
  version: string;
}
interface Waiting {
  waiting: "approval";
  plan: Plan;
}

async function serve(): Promise<void> {
  const worker = new Worker({ url, token, workerId: process.env.WORKER_ID ?? "deployer-1" });
  worker.function("deploy.plan", { concurrency: 8, timeoutMs: 60_000 }, async (ctx, input) => {
    const answer = resumed<Waiting, { approved: boolean; by: string }>(input);
    if (answer?.state.waiting !== "approval") {
      // Step 0: plan, then ask. The state says what it waits for, so the next step
      // knows its input is the answer.
      const request = input as { service: string; version?: string };
      const plan: Plan = { service: request.service, version: request.version ?? "latest" };
      const prompt = `Deploy ${plan.service} ${plan.version} to production? (yes/no)`;
      return new Suspend({ waiting: "approval", plan } satisfies Waiting, { prompt, timeoutMs: 3_600_000 });
    }
    const { plan } = answer.state;
    if (answer.input?.approved !== true) return { deployed: false, plan, by: null };
    console.error(`[${ctx.turnId}] deploying ${plan.service} ${plan.version}`); // the real deployment goes here
    return { deployed: true, plan, by: answer.input.by };
  });
  worker.on("state", (state: string) => console.error(`[worker] ${state}`));
  await worker.run();
}

async function request(service: string): Promise<void> {
  const client = await connect({ url, token });
  try {
    const { turnId } = await client.submit(process.env.SESSION_ID ?? "deploys", "deploy.plan", { service });
    for await (const item of await client.stream(turnId)) {
      if (isEvent(item) && item.kind === "suspended") break;
    }
    const turn = await client.get(turnId);
    if (!turn.inputRequest) throw new Error(`turn ${turnId} is ${turn.status}, not waiting`);
    console.log(`${turnId} asks: ${String(turn.inputRequest.prompt)}`);
  } finally {
    await client.close();
  }
}

async function answer(turnId: string, yes: boolean): Promise<void> {
  const client = await connect({ url, token });
  try {
    // The key makes a repeated answer (a retry after a lost connection) harmless.
    await client.resume(turnId, { approved: yes, by: "cli" }, { idempotencyKey: `answer-${turnId}` });
    const turn = await client.wait(turnId, { timeoutMs: 60_000 });
    console.log(`${turnId} ${turn.status}: ${JSON.stringify(turn.output)}`);
  } finally {
    await client.close();
  }
}

const [command, arg, yes] = process.argv.slice(2);
if (command === "worker") await serve();
else if (command === "request") await request(arg ?? "billing");
else if (command === "answer" && arg !== undefined) await answer(arg, yes === "yes");
else throw new Error("usage: approval.js worker | request SERVICE | answer TURN_ID yes|no");
