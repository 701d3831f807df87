// An ARL agent in JavaScript, on the `openai` npm package (`npm install` in this folder; Node.js 18+).
//
// Two ways to run the same program:
//   1. as a subprocess agent: a Python agent function starts it per session with OPENAI_BASE_URL / OPENAI_API_KEY
//      (the session's) and the prompt; it prints its answer, which the env scores:
//          node agent.mjs --prompt "12+7="
//   2. as an external agent (agent.name=external): it takes episodes from the run's task API, answers each
//      through its session and asks the env to score it ({"reward": null}):
//          node agent.mjs --run-dir runs/ext [--concurrency 16] [--episodes N] [--delay-ms MS]
//      (--delay-ms: think time before each answer, e.g. to see what a slow or vanishing agent costs a run)
import OpenAI from "openai";
import { readdirSync, readFileSync } from "node:fs";
import { join } from "node:path";

function arg(name, fallback) {
  const i = process.argv.indexOf(name);
  return i >= 0 ? process.argv[i + 1] : fallback;
}

async function answer(client, prompt) {
  const reply = await client.chat.completions.create({
    model: "policy",
    messages: [{ role: "user", content: prompt }],
  });
  return (reply.choices[0].message.content ?? "").trim();
}

async function workers(runDir) {
  const folder = join(runDir, "task_api");
  for (let i = 0; i < 600; i++) {
    let files = [];
    try {
      files = readdirSync(folder).filter((f) => f.startsWith("rollout") && f.endsWith(".json"));
    } catch {}
    if (files.length) return files.map((f) => JSON.parse(readFileSync(join(folder, f), "utf8")));
    await new Promise((r) => setTimeout(r, 500));
  }
  throw new Error(`no task API under ${folder}: is the run using agent.name=external?`);
}

async function post(worker, path, body) {
  const r = await fetch(worker.episodes + path, {
    method: "POST",
    headers: { Authorization: `Bearer ${worker.key}`, "Content-Type": "application/json" },
    body: JSON.stringify(body),
  });
  return { status: r.status, body: r.status === 204 ? null : await r.json() };
}

async function external(runDir, concurrency, limit, delayMs) {
  const pool = await workers(runDir);
  let next = 0, done = 0;
  async function loop() {
    let failures = 0;
    while (!limit || done < limit) {
      const worker = pool[next++ % pool.length];
      let taken;
      try {
        taken = await post(worker, "", { wait_s: 20 });
        failures = 0;
      } catch {
        if (++failures >= 10) return; // the run has ended
        await new Promise((r) => setTimeout(r, 1000));
        continue;
      }
      if (taken.status !== 200) continue;
      const ep = taken.body;
      const client = new OpenAI({ baseURL: ep.base_url, apiKey: ep.api_key, maxRetries: 0 });
      if (delayMs) await new Promise((r) => setTimeout(r, delayMs));
      try {
        await answer(client, ep.prompt.prompt);
      } catch {
        continue; // the group ended under us (its deadline)
      }
      await post(worker, `/${ep.episode_id}/reward`, { reward: null });
      done++;
    }
  }
  await Promise.all(Array.from({ length: concurrency }, loop));
  console.log(`${done} episodes rewarded`);
}

if (arg("--prompt") !== undefined) {
  const client = new OpenAI({ maxRetries: 0 }); // OPENAI_BASE_URL and OPENAI_API_KEY: the session's
  console.log(await answer(client, arg("--prompt")));
} else if (arg("--run-dir") !== undefined) {
  await external(arg("--run-dir"), Number(arg("--concurrency", "16")), Number(arg("--episodes", "0")),
                 Number(arg("--delay-ms", "0")));
} else {
  console.error("usage: node agent.mjs --prompt TEXT | --run-dir RUN_DIR [--concurrency N] [--episodes N] " +
                "[--delay-ms MS]");
  process.exit(2);
}
