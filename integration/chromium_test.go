package integration_test

import (
	"bufio"
	"bytes"
	"encoding/base64"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

// browser drives one headless Chromium over the DevTools protocol on a pipe
// (--remote-debugging-pipe: commands in on fd 3, replies and events out on fd 4, each message
// ended by a NUL byte), so that a test can size the viewport, run script in the page, wait for
// the page to change and take screenshots, with nothing beyond the standard library.
type browser struct {
	t   *testing.T
	cmd *exec.Cmd
	toChrome,
	fromChrome *os.File
	stderr  *bytes.Buffer
	replies *bufio.Reader
	nextID  int
	session string
	waited  sync.Once
}

// startBrowser launches headless Chromium with one blank page and attaches to it.
func startBrowser(t *testing.T) *browser {
	t.Helper()
	chromium := findChromium(t)
	// Our ends: we write commands to cmdW and read replies from outR; Chromium gets cmdR as fd 3
	// and outW as fd 4.
	cmdR, cmdW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	args := []string{"--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
		"--disable-background-networking", "--disable-component-update", "--disable-sync",
		"--user-data-dir=" + t.TempDir(), "--remote-debugging-pipe", "about:blank"}
	b := &browser{t: t, cmd: exec.Command(chromium, args...), toChrome: cmdW, fromChrome: outR, stderr: &bytes.Buffer{}}
	b.cmd.ExtraFiles = []*os.File{cmdR, outW}
	b.cmd.Stderr = b.stderr
	if err := b.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// The child holds its own copies.
	cmdR.Close()
	outW.Close()
	b.replies = bufio.NewReader(outR)
	t.Cleanup(b.close)

	var target struct {
		TargetID string `json:"targetId"`
	}
	b.call("", "Target.createTarget", map[string]any{"url": "about:blank"}, &target)
	var attached struct {
		SessionID string `json:"sessionId"`
	}
	b.call("", "Target.attachToTarget", map[string]any{"targetId": target.TargetID, "flatten": true}, &attached)
	b.session = attached.SessionID
	return b
}

func (b *browser) close() {
	b.waited.Do(func() {
		// Closing the command pipe is how a pipe client says goodbye; Browser.close first for a
		// prompt exit.
		_, _ = b.toChrome.Write(append([]byte(`{"id":999999,"method":"Browser.close"}`), 0))
		b.toChrome.Close()
		done := make(chan struct{})
		go func() {
			_, _ = io.Copy(io.Discard, b.fromChrome)
			close(done)
		}()
		exited := make(chan error, 1)
		go func() { exited <- b.cmd.Wait() }()
		select {
		case <-exited:
		case <-time.After(10 * time.Second):
			_ = b.cmd.Process.Kill()
			<-exited
		}
		b.fromChrome.Close()
		<-done
	})
}

// call sends one command (to the page when session is set, else to the browser) and decodes its
// result into out, failing the test on a protocol error or after 30 s without a reply.
func (b *browser) call(session, method string, params any, out any) {
	b.t.Helper()
	b.nextID++
	id := b.nextID
	msg := map[string]any{"id": id, "method": method, "params": params}
	if session != "" {
		msg["sessionId"] = session
	}
	data, err := json.Marshal(msg)
	if err != nil {
		b.t.Fatal(err)
	}
	if _, err := b.toChrome.Write(append(data, 0)); err != nil {
		b.t.Fatalf("%s: %v\n%s", method, err, b.stderr.String())
	}
	_ = b.fromChrome.SetReadDeadline(time.Now().Add(30 * time.Second))
	for {
		line, err := b.replies.ReadBytes(0)
		if err != nil {
			b.t.Fatalf("%s: no reply: %v\nchromium stderr:\n%s", method, err, b.stderr.String())
		}
		var reply struct {
			ID     int             `json:"id"`
			Result json.RawMessage `json:"result"`
			Error  *struct {
				Message string `json:"message"`
			} `json:"error"`
		}
		if err := json.Unmarshal(line[:len(line)-1], &reply); err != nil {
			b.t.Fatalf("%s: %v in %q", method, err, line)
		}
		if reply.ID != id {
			continue // an event, or the reply to something else
		}
		if reply.Error != nil {
			b.t.Fatalf("%s: %s", method, reply.Error.Message)
		}
		if out != nil {
			if err := json.Unmarshal(reply.Result, out); err != nil {
				b.t.Fatalf("%s: %v in %s", method, err, reply.Result)
			}
		}
		return
	}
}

// viewport sizes the page like a desktop window of width × height CSS pixels.
func (b *browser) viewport(width, height int) {
	b.t.Helper()
	b.call(b.session, "Emulation.setDeviceMetricsOverride",
		map[string]any{"width": width, "height": height, "deviceScaleFactor": 1, "mobile": false}, nil)
}

func (b *browser) navigate(url string) {
	b.t.Helper()
	b.call(b.session, "Page.navigate", map[string]any{"url": url}, nil)
}

// eval runs expression in the page (awaiting it when it is a promise) and decodes its value,
// which must be JSON, into out.
func (b *browser) eval(expression string, out any) {
	b.t.Helper()
	var r struct {
		Result struct {
			Value json.RawMessage `json:"value"`
		} `json:"result"`
		ExceptionDetails *struct {
			Text      string `json:"text"`
			Exception struct {
				Description string `json:"description"`
			} `json:"exception"`
		} `json:"exceptionDetails"`
	}
	b.call(b.session, "Runtime.evaluate", map[string]any{"expression": expression, "returnByValue": true, "awaitPromise": true}, &r)
	if r.ExceptionDetails != nil {
		b.t.Fatalf("script failed: %s %s", r.ExceptionDetails.Text, r.ExceptionDetails.Exception.Description)
	}
	if out != nil {
		if err := json.Unmarshal(r.Result.Value, out); err != nil {
			b.t.Fatalf("%v in %s", err, r.Result.Value)
		}
	}
}

// waitUntil evaluates the boolean expression until it holds, failing after timeout with what.
// The page polls the server every two seconds, so the timeouts that callers give are generous.
func (b *browser) waitUntil(timeout time.Duration, what, expression string) {
	b.t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		var ok bool
		// Before the page has loaded, the expression may throw: that is "not yet".
		b.eval("(() => { try { return Boolean("+expression+"); } catch (e) { return false; } })()", &ok)
		if ok {
			return
		}
		if time.Now().After(deadline) {
			b.t.Fatalf("the page did not show %s within %v", what, timeout)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// screenshot saves the whole page (not only the viewport) as a PNG named name in the
// directory LLM_BULKHEAD_SCREENSHOTS names, or in the test's temporary directory, and logs the
// path.
func (b *browser) screenshot(name string) {
	b.t.Helper()
	var size struct {
		W float64 `json:"w"`
		H float64 `json:"h"`
	}
	b.eval(`({w: document.documentElement.scrollWidth, h: document.documentElement.scrollHeight})`, &size)
	var shot struct {
		Data string `json:"data"`
	}
	b.call(b.session, "Page.captureScreenshot", map[string]any{"format": "png", "captureBeyondViewport": true,
		"clip": map[string]any{"x": 0, "y": 0, "width": size.W, "height": size.H, "scale": 1}}, &shot)
	png, err := base64.StdEncoding.DecodeString(shot.Data)
	if err != nil {
		b.t.Fatal(err)
	}
	dir := os.Getenv("LLM_BULKHEAD_SCREENSHOTS")
	if dir == "" {
		dir = b.t.TempDir()
	} else if err := os.MkdirAll(dir, 0o755); err != nil {
		b.t.Fatal(err)
	}
	path := filepath.Join(dir, name)
	if err := os.WriteFile(path, png, 0o644); err != nil {
		b.t.Fatal(err)
	}
	b.t.Logf("screenshot %s (%.0f×%.0f px)", path, size.W, size.H)
}
