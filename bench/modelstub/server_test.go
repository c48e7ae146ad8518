package modelstub

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"
)

// agent plays the agent CLI's side over HTTP: it sends the conversation,
// reads the streamed answer as the SDK does (joining deltas per block),
// and runs each tool call through exec.
type agent struct {
	t      *testing.T
	url    string
	key    string
	stream bool
	msgs   []map[string]any
	// events are the SSE event names of every streamed answer, in order.
	events [][]string
}

var agentTools = []map[string]any{{"name": "Bash"}, {"name": "Read"}, {"name": "Edit"}}

// call sends the conversation and returns the assistant's content blocks
// and stop reason.
func (a *agent) call(tools []map[string]any) ([]block, string) {
	a.t.Helper()
	body, _ := json.Marshal(map[string]any{"model": "claude-test", "max_tokens": 1024, "stream": a.stream, "messages": a.msgs, "tools": tools})
	req, _ := http.NewRequest(http.MethodPost, a.url+"/v1/messages?beta=true", bytes.NewReader(body))
	req.Header.Set("x-api-key", a.key)
	req.Header.Set("User-Agent", "test-agent/1.0")
	req.Header.Set("content-type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		a.t.Fatalf("POST /v1/messages: %v", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		var e map[string]any
		_ = json.NewDecoder(resp.Body).Decode(&e)
		a.t.Fatalf("POST /v1/messages: %s %v", resp.Status, e)
	}
	if !a.stream {
		var m struct {
			Content    []block `json:"content"`
			StopReason string  `json:"stop_reason"`
		}
		if err := json.NewDecoder(resp.Body).Decode(&m); err != nil {
			a.t.Fatal(err)
		}
		return m.Content, m.StopReason
	}
	if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
		a.t.Fatalf("streamed answer has content type %q", ct)
	}
	var names []string
	var content []block
	partial := map[int]*strings.Builder{}
	stop := ""
	sc := bufio.NewScanner(resp.Body)
	var event string
	for sc.Scan() {
		line := sc.Text()
		if e, ok := strings.CutPrefix(line, "event: "); ok {
			event = e
			continue
		}
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok {
			continue
		}
		var ev struct {
			Type         string          `json:"type"`
			Index        int             `json:"index"`
			ContentBlock block           `json:"content_block"`
			Delta        json.RawMessage `json:"delta"`
		}
		if err := json.Unmarshal([]byte(data), &ev); err != nil {
			a.t.Fatalf("event %s: %v: %s", event, err, data)
		}
		if ev.Type != event {
			a.t.Fatalf("event line %q carries data of type %q", event, ev.Type)
		}
		names = append(names, event)
		switch event {
		case "content_block_start":
			if ev.Index != len(content) {
				a.t.Fatalf("content block %d started after %d blocks", ev.Index, len(content))
			}
			content = append(content, ev.ContentBlock)
			partial[ev.Index] = &strings.Builder{}
		case "content_block_delta":
			var d struct {
				Type        string `json:"type"`
				Text        string `json:"text"`
				PartialJSON string `json:"partial_json"`
			}
			_ = json.Unmarshal(ev.Delta, &d)
			switch {
			case d.Type == "text_delta" && content[ev.Index].Type == "text":
				partial[ev.Index].WriteString(d.Text)
			case d.Type == "input_json_delta" && content[ev.Index].Type == "tool_use":
				partial[ev.Index].WriteString(d.PartialJSON)
			default:
				a.t.Fatalf("delta %s for a %s block", d.Type, content[ev.Index].Type)
			}
		case "content_block_stop":
			b := &content[ev.Index]
			if b.Type == "text" {
				b.Text = partial[ev.Index].String()
			} else {
				b.Input = json.RawMessage(partial[ev.Index].String())
			}
		case "message_delta":
			var d struct {
				StopReason string `json:"stop_reason"`
			}
			_ = json.Unmarshal(ev.Delta, &d)
			stop = d.StopReason
		}
	}
	a.events = append(a.events, names)
	return content, stop
}

// run plays a whole episode: exec answers each tool call. It returns the
// final text.
func (a *agent) run(prompt string, exec func(name string, input map[string]any) Result) string {
	a.t.Helper()
	a.msgs = []map[string]any{{"role": "user", "content": prompt}}
	for range 50 {
		content, stop := a.call(agentTools)
		a.msgs = append(a.msgs, map[string]any{"role": "assistant", "content": content})
		if stop != "tool_use" {
			var text []string
			for _, b := range content {
				text = append(text, b.Text)
			}
			return strings.Join(text, "")
		}
		var res []map[string]any
		for _, b := range content {
			if b.Type != "tool_use" {
				continue
			}
			var in map[string]any
			if err := json.Unmarshal(b.Input, &in); err != nil {
				a.t.Fatalf("tool input %s: %v", b.Input, err)
			}
			r := exec(b.Name, in)
			// The CLI sends results as text blocks, with system
			// reminders appended in the same message.
			res = append(res, map[string]any{"type": "tool_result", "tool_use_id": b.ID, "is_error": r.IsError,
				"content": []map[string]any{{"type": "text", "text": r.Text}}})
		}
		res = append(res, map[string]any{"type": "text", "text": "<system-reminder>ok</system-reminder>"})
		a.msgs = append(a.msgs, map[string]any{"role": "user", "content": res})
	}
	a.t.Fatal("no final answer after 50 turns")
	return ""
}

// repoExec answers the episode's commands as a repository whose bug is
// applied until `git apply` of the fix runs; broken names a step whose
// result is wrong.
func repoExec(t *testing.T, broken string) (func(string, map[string]any) Result, *[]string) {
	fixed := false
	var ran []string
	return func(name string, in map[string]any) Result {
		cmd, _ := in["command"].(string)
		if name == "Read" {
			cmd, _ = in["file_path"].(string)
		}
		ran = append(ran, name+" "+cmd)
		if strings.HasSuffix(cmd, "go test ./...") && in["timeout"] != float64(BashMaxTimeout.Milliseconds()) {
			t.Errorf("%s without the Bash tool's longest timeout: %v", cmd, in)
		}
		var r Result
		switch {
		case strings.HasSuffix(cmd, "git status"):
			r = Result{Text: "On branch master\nChanges not staged for commit:\n\tmodified:   hash.go"}
		case strings.HasSuffix(cmd, "git log --oneline -5"):
			r = Result{Text: "abc123 initial"}
		case strings.HasSuffix(cmd, "git ls-files"):
			r = Result{Text: "go.mod\nhash.go\nuuid.go"}
		case strings.Contains(cmd, "grep -rn"):
			r = Result{Text: "./hash.go:12:func NewHash(h hash.Hash) UUID {"}
		case strings.HasSuffix(cmd, "/go.mod"):
			r = Result{Text: "     1\tmodule github.com/google/uuid\n"}
		case strings.HasSuffix(cmd, ".go"):
			r = Result{Text: "     1\tpackage uuid\n"}
		case strings.Contains(cmd, "git apply /opt/tasks/fix.diff"):
			fixed = true
		case strings.HasSuffix(cmd, "go test ./...") && !fixed:
			r = Result{Text: "--- FAIL: TestHash\nFAIL\tgithub.com/google/uuid\t0.01s\nFAIL", IsError: true}
		case strings.HasSuffix(cmd, "go test ./..."):
			r = Result{Text: "ok  \tgithub.com/google/uuid\t0.02s"}
		case strings.HasSuffix(cmd, "git diff | wc -l)"):
			r = Result{Text: "diff-lines=0"}
		default:
			t.Fatalf("unexpected tool call %s %v", name, in)
		}
		if strings.Contains(cmd, broken) && broken != "" {
			r = Result{Text: "ok  \tgithub.com/google/uuid\t0.02s"} // the bug did not make the tests fail
		}
		return r
	}, &ran
}

func testScript() Script {
	return EpisodeScript("/workspace/uuid", "/opt/tasks/fix.diff", []string{"hash.go"}, "Fixed: rollout-7 done.")
}

func newTestServer(t *testing.T) (*Server, *httptest.Server, *bytes.Buffer) {
	var log bytes.Buffer
	s, err := New(Think{Median: 10 * time.Millisecond, Fixed: true}, &log)
	if err != nil {
		t.Fatal(err)
	}
	s.PingEvery = 2 * time.Millisecond
	hs := httptest.NewServer(s)
	t.Cleanup(hs.Close)
	return s, hs, &log
}

func TestEpisodeCompletes(t *testing.T) {
	for _, stream := range []bool{true, false} {
		t.Run(fmt.Sprintf("stream=%v", stream), func(t *testing.T) {
			s, hs, log := newTestServer(t)
			firsts := make(chan string, 100)
			s.OnFirstRequest = func(key string) { firsts <- key }
			s.Register("rollout-7", "uuid-hash/0", testScript())
			a := &agent{t: t, url: hs.URL, key: "rollout-7", stream: stream}
			exec, ran := repoExec(t, "")
			final := a.run("Fix the failing tests in /workspace/uuid.", exec)
			if final != "Fixed: rollout-7 done." {
				t.Fatalf("final answer %q", final)
			}
			want := []string{"Bash cd /workspace/uuid && git status", "Bash cd /workspace/uuid && git log --oneline -5", "Bash cd /workspace/uuid && git ls-files",
				"Bash cd /workspace/uuid && grep -rn --include='*.go' -m 3 '^func ' .", "Read /workspace/uuid/go.mod", "Read /workspace/uuid/hash.go",
				"Bash cd /workspace/uuid && go test ./...", "Bash cd /workspace/uuid && git apply /opt/tasks/fix.diff", "Bash cd /workspace/uuid && go test ./...",
				"Bash cd /workspace/uuid && git diff --stat; echo diff-lines=$(git diff | wc -l)"}
			if !slices.Equal(*ran, want) {
				t.Fatalf("tool calls:\n%s\nwant\n%s", strings.Join(*ran, "\n"), strings.Join(want, "\n"))
			}
			o, _ := s.Outcome("rollout-7")
			if err := o.Verdict(); err != nil {
				t.Fatalf("verdict %v (%+v)", err, o)
			}
			if o.Requests != len(want)+1 || o.Steps != len(want) || o.FirstRequest.IsZero() || o.Think != time.Duration(len(want)+1)*10*time.Millisecond || o.UserAgent != "test-agent/1.0" {
				t.Fatalf("outcome %+v", o)
			}
			if key := <-firsts; key != "rollout-7" || len(firsts) != 0 {
				t.Fatalf("first request reported for %q, then %d more times", key, len(firsts))
			}
			if stream {
				for i, ev := range a.events {
					// message_start, pings while thinking, blocks, then the
					// stop reason and message_stop, as the API sends them.
					if ev[0] != "message_start" || ev[len(ev)-2] != "message_delta" || ev[len(ev)-1] != "message_stop" || !slices.Contains(ev, "ping") {
						t.Fatalf("answer %d: events %v", i, ev)
					}
				}
			}
			turns := strings.Count(log.String(), `"event":"turn"`)
			if turns != len(want)+1 {
				t.Fatalf("logged %d turns, want %d:\n%s", turns, len(want)+1, log)
			}
		})
	}
}

func TestWrongResultFailsRollout(t *testing.T) {
	s, hs, log := newTestServer(t)
	s.Register("rollout-8", "uuid-hash/1", testScript())
	a := &agent{t: t, url: hs.URL, key: "rollout-8", stream: true}
	// The tests pass before the fix: the task is broken, not solved.
	exec, ran := repoExec(t, "go test ./...")
	final := a.run("Fix the failing tests.", exec)
	if !strings.HasPrefix(final, "Rollout failed: step 7 (test-before)") {
		t.Fatalf("final answer %q", final)
	}
	if len(*ran) != 7 {
		t.Fatalf("the agent ran %d tool calls after the failure, want 7: %v", len(*ran), *ran)
	}
	o, _ := s.Outcome("rollout-8")
	if err := o.Verdict(); err == nil || !strings.Contains(err.Error(), "want a failure") {
		t.Fatalf("verdict %v", err)
	}
	if !strings.Contains(log.String(), `"step":"failed"`) {
		t.Fatalf("failure not logged:\n%s", log)
	}
}

func TestIncompleteRolloutFails(t *testing.T) {
	s, hs, _ := newTestServer(t)
	s.Register("rollout-9", "cli-x/0", testScript())
	if _, ok := s.Outcome("nobody"); ok {
		t.Fatal("outcome for an unregistered key")
	}
	o, _ := s.Outcome("rollout-9")
	if err := o.Verdict(); err == nil || !strings.Contains(err.Error(), "never called") {
		t.Fatalf("verdict before any request: %v", err)
	}
	a := &agent{t: t, url: hs.URL, key: "rollout-9", stream: true}
	a.msgs = []map[string]any{{"role": "user", "content": "go"}}
	if _, stop := a.call(agentTools); stop != "tool_use" {
		t.Fatalf("first answer stops with %q", stop)
	}
	o, _ = s.Outcome("rollout-9")
	if err := o.Verdict(); err == nil || !strings.Contains(err.Error(), "stopped after 0") {
		t.Fatalf("verdict after the agent quit: %v", err)
	}
	// A side query (no tools) is answered but moves nothing.
	a.call(nil)
	if o, _ = s.Outcome("rollout-9"); o.SideRequests != 1 || o.Requests != 2 || o.Done {
		t.Fatalf("after a side query: %+v", o)
	}
	// An unknown key is refused as the API refuses a bad key.
	resp, err := http.Post(hs.URL+"/v1/messages", "application/json", strings.NewReader(`{"messages":[]}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("request without a key: %s", resp.Status)
	}
}

func TestThinkDraws(t *testing.T) {
	th := Think{Median: 6 * time.Second, P95: 20 * time.Second, Seed: 42}
	var ds []float64
	for i := range 4000 {
		d := th.Draw(fmt.Sprintf("task-%d/0", i%40), i/40)
		if d != th.Draw(fmt.Sprintf("task-%d/0", i%40), i/40) {
			t.Fatal("the same sample and turn drew two times")
		}
		ds = append(ds, d.Seconds())
	}
	sort.Float64s(ds)
	med, p95 := ds[len(ds)/2], ds[len(ds)*95/100]
	// 4000 draws: the sample quantiles are within a few percent.
	if med < 5.4 || med > 6.6 || p95 < 17 || p95 > 23 {
		t.Fatalf("median %.2fs p95 %.2fs, want about 6 and 20", med, p95)
	}
	if other := (Think{Median: 6 * time.Second, P95: 20 * time.Second, Seed: 43}).Draw("task-1/0", 0); other == th.Draw("task-1/0", 0) {
		t.Fatal("another seed drew the same time")
	}
	if d := (Think{Median: 2 * time.Second, P95: 20 * time.Second, Fixed: true}).Draw("x", 3); d != 2*time.Second {
		t.Fatalf("fixed mode drew %s", d)
	}
	if m := maxDraw(Think{Median: time.Second, P95: 100 * time.Second, Max: 3 * time.Second}); m != 3*time.Second {
		t.Fatalf("largest of 500 draws with a p95 of 100 s capped at 3 s: %s", m)
	}
	if err := (Think{Median: 6 * time.Second, P95: time.Second}).Validate(); err == nil {
		t.Fatal("p95 below the median accepted")
	}
}

func maxDraw(th Think) time.Duration {
	var m time.Duration
	for i := range 500 {
		m = max(m, th.Draw("s", i))
	}
	return m
}
