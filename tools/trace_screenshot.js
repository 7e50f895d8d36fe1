// Opens a `memstep trace` file in Chromium's own trace viewer (the DevTools Performance panel,
// served by the browser itself: nothing is fetched from outside) and writes a screenshot.
//
//   npm install puppeteer-core        (drives the system's Chromium; downloads no browser)
//   node tools/trace_screenshot.js trace.json shot.png [chromium binary]
//
// The panel loads the trace through its `loadTimelineFromURL` parameter. Its page may fetch from
// its own origin only, so the trace is answered at that origin by request interception. The panel
// draws the engine's step slices and their args; it draws neither counters nor the requests'
// async spans (Perfetto's UI does, but it is not served offline).
const fs = require('fs');
const {spawn} = require('child_process');
const puppeteer = require('puppeteer-core');

const TRACE_PATH = '/memstep-trace.json';
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function main() {
  const [tracePath, out, chromium = '/usr/lib/chromium/chromium'] = process.argv.slice(2);
  if (!tracePath || !out) throw new Error('usage: trace_screenshot.js TRACE.json OUT.png');
  const trace = fs.readFileSync(tracePath);
  const chrome = await startChromium(chromium);
  const browser = await puppeteer.connect({browserWSEndpoint: chrome.endpoint});
  try {
    const origin = new URL(chrome.endpoint).origin.replace('ws:', 'http:');
    const [page] = await browser.pages();
    await page.setViewport({width: 1600, height: 1000});
    await page.setRequestInterception(true);
    page.on('request', (r) => (new URL(r.url()).pathname === TRACE_PATH
      ? r.respond({status: 200, contentType: 'application/json', body: trace})
      : r.continue()));
    const url = `${origin}/devtools/trace_app.html?loadTimelineFromURL=${origin}${TRACE_PATH}`;
    await page.goto(url, {waitUntil: 'load'});
    await sleep(5000); // the panel parses and draws the trace
    await expandEngineTracks(page);
    await page.screenshot({path: out});
  } finally {
    browser.disconnect();
    chrome.process.kill();
  }
}

// Positions are the panel's at 1600x1000 with its sidebar open: close the first-run shortcuts
// dialog, expand the engine's group (the panel draws groups collapsed) and its steps track, and
// select one step, so that the summary shows its args (step, batch size, tokens).
async function expandEngineTracks(page) {
  await page.mouse.click(1571, 77);
  await sleep(800);
  await page.mouse.click(252, 129);
  await sleep(800);
  await page.mouse.click(260, 146);
  await sleep(800);
  await page.mouse.click(700, 162);
  await sleep(1500);
}

// Chromium, headless, with a debugging port on the loopback: the port serves the DevTools pages.
function startChromium(path) {
  const profile = fs.mkdtempSync('/tmp/trace-shot-');
  const args = ['--headless', '--no-sandbox', '--disable-gpu', '--remote-debugging-port=0',
    '--remote-debugging-address=127.0.0.1', `--user-data-dir=${profile}`, 'about:blank'];
  const child = spawn(path, args, {stdio: ['ignore', 'ignore', 'pipe']});
  return new Promise((resolve, reject) => {
    let said = '';
    child.stderr.on('data', (chunk) => {
      said += chunk;
      const found = said.match(/DevTools listening on (ws:\/\/\S+)/);
      if (found) resolve({process: child, endpoint: found[1]});
    });
    child.on('exit', (code) => reject(new Error(`chromium exited (${code}): ${said}`)));
  });
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
