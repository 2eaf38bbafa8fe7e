// Opens an experiment in the MLflow UI with headless Chromium (Debian's, driven by playwright-core)
// and checks that the pipeline run and its stage runs are listed; saves a screenshot either way.
//
//   node tests/ui/mlflow_ui_check.mjs --url http://127.0.0.1:5000 --experiment 1 --parent pipeline \
//        --children prepare,sft,reward,rloo,evaluate --screenshot /tmp/mlflow-ui.png \
//        [--run rloo --metrics train/reward_mean,train/kl --run-screenshot /tmp/mlflow-run.png]
//
// With --run, it also opens that stage run's page: the parent run and the metrics must be shown
// there, and --run-screenshot saves its metric charts (filtered by --chart-filter, default train/).
// Exit status 0 when every run is listed, 1 otherwise (the reason on stderr), 2 on a usage error.
// CHROMIUM overrides the browser (default /usr/bin/chromium); no browser is ever downloaded.
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { chromium } from 'playwright-core';

function parseArgs(argv) {
  const out = {};
  for (let i = 0; i < argv.length; i += 2) {
    if (!argv[i].startsWith('--') || argv[i + 1] === undefined) {
      console.error(`usage error near ${argv[i]}`);
      process.exit(2);
    }
    out[argv[i].slice(2)] = argv[i + 1];
  }
  for (const key of ['url', 'experiment', 'parent', 'screenshot']) {
    if (!out[key]) {
      console.error(`missing --${key}`);
      process.exit(2);
    }
  }
  out.children = (out.children || '').split(',').filter(Boolean);
  out.timeout = Number(out.timeout || 90000);
  return out;
}

const args = parseArgs(process.argv.slice(2));
const userDataDir = fs.mkdtempSync(path.join(os.tmpdir(), 'rloo-chromium-'));
const exact = (name) => new RegExp(`^\\s*${name.replace(/[.*+?^${}()|[\]\\]/g, '\\$&')}\\s*$`);

let context;
let failure = null;
try {
  context = await chromium.launchPersistentContext(userDataDir, {
    executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
    headless: true,
    viewport: { width: 1600, height: 1000 },
    args: [
      '--no-sandbox', '--disable-gpu', '--disable-background-networking', '--disable-component-update',
      '--disable-sync', '--no-first-run', '--disable-quic', '--disable-dev-shm-usage',
    ],
  });
  const page = context.pages()[0] || (await context.newPage());
  page.setDefaultTimeout(args.timeout);
  // The experiment's runs table ("Model training" view; MLflow 3 opens GenAI's overview otherwise).
  const target = `${args.url.replace(/\/$/, '')}/#/experiments/${args.experiment}/runs?workflowType=machine_learning`;
  await page.goto(target, { waitUntil: 'domcontentloaded' });
  const parentRow = page.locator('[role=row]').filter({ has: page.locator('a', { hasText: exact(args.parent) }) }).first();
  await parentRow.waitFor({ state: 'visible' });
  // MLflow's assistant panel takes a third of the width: close it when it is there.
  const close = page.getByRole('button', { name: /close/i }).first();
  if (await close.isVisible().catch(() => false)) await close.click().catch(() => {});
  // Child runs are folded under their parent: unfold them.
  if (args.children.length) {
    const expander = parentRow.locator('button[data-component-id*="runnamecellrenderer"]').first();
    if (await expander.count()) await expander.click();
  }
  const found = [];
  for (const name of args.children) {
    const link = page.locator('[role=row] a', { hasText: exact(name) }).first();
    try {
      await link.waitFor({ state: 'visible', timeout: Math.min(args.timeout, 30000) });
      found.push(name);
    } catch {
      // keep looking for the others, then report all that are missing
    }
  }
  const missing = args.children.filter((n) => !found.includes(n));
  await page.waitForTimeout(500);
  await page.screenshot({ path: args.screenshot, fullPage: true });
  const report = { url: target, parent: args.parent, found, missing, screenshot: args.screenshot };
  if (missing.length) failure = `runs not listed in the UI: ${missing.join(', ')}`;
  // One stage run's page: its parent, its metrics (Overview), then their curves (Model metrics).
  if (!failure && args.run) {
    // Straight to the run's page, keeping the "Model training" view (a click would drop the query).
    const href = await page.locator('[role=row] a', { hasText: exact(args.run) }).first().getAttribute('href');
    await page.goto(`${args.url.replace(/\/$/, '')}/${href}?workflowType=machine_learning`);
    await page.getByText('Parent run').first().waitFor({ state: 'visible' });
    const parentLink = page.getByRole('link', { name: exact(args.parent) }).first();
    const parentListed = await parentLink.waitFor({ state: 'visible', timeout: 30000 }).then(() => true, () => false);
    const metrics = (args.metrics || '').split(',').filter(Boolean);
    const shown = [];
    for (const m of metrics) {
      const cell = page.getByText(m, { exact: true }).first();
      if (await cell.waitFor({ state: 'visible', timeout: 15000 }).then(() => true, () => false)) shown.push(m);
    }
    report.run = { name: args.run, parent_listed: parentListed, metrics_shown: shown };
    const absent = metrics.filter((m) => !shown.includes(m));
    if (absent.length) failure = `run ${args.run}: metrics not shown: ${absent.join(', ')}`;
    else if (!report.run.parent_listed) failure = `run ${args.run}: parent run ${args.parent} not shown`;
    if (args['run-screenshot']) {
      await page.getByRole('tab', { name: 'Model metrics' }).click();
      const search = page.getByPlaceholder(/search metric charts/i);
      if (await search.count()) await search.fill(args['chart-filter'] || 'train/');
      await page.setViewportSize({ width: 1600, height: 2400 }); // the charts scroll inside the page
      await page.waitForTimeout(3000);
      await page.screenshot({ path: args['run-screenshot'], fullPage: true });
      report.run.screenshot = args['run-screenshot'];
    }
  }
  console.log(JSON.stringify(report));
} catch (err) {
  failure = `${err.name}: ${err.message}`;
  if (context) {
    const page = context.pages()[0];
    if (page) {
      await page.screenshot({ path: args.screenshot, fullPage: true }).catch(() => {});
      const text = await page.evaluate(() => document.body.innerText).catch(() => '');
      console.error(`page text:\n${text.slice(0, 2000)}`);
    }
  }
} finally {
  if (context) await context.close().catch(() => {});
  fs.rmSync(userDataDir, { recursive: true, force: true });
}
if (failure) {
  console.error(failure);
  process.exit(1);
}
