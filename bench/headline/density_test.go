package headline

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/envsnap/envsnap/bench/episode"
	"github.com/envsnap/envsnap/bench/modelstub"
)

// fakeAgent plays one episode of the agent's loop against the recorder
// (non-streaming answers): it runs each tool call by sleeping toolTime,
// then returns the result; with stopAfter > 0 it quits after that many
// tool calls without asking for the final answer.
func fakeAgent(t *testing.T, url, key string, toolTime time.Duration, stopAfter int) {
	t.Helper()
	var msgs []map[string]any
	msgs = append(msgs, map[string]any{"role": "user", "content": "fix it"})
	for calls := 0; ; calls++ {
		body, _ := json.Marshal(map[string]any{"model": "m", "max_tokens": 64, "messages": msgs, "tools": []map[string]any{{"name": "Bash"}}})
		req, _ := http.NewRequest(http.MethodPost, url+"/v1/messages", bytes.NewReader(body))
		req.Header.Set("x-api-key", key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		var m struct {
			Content []struct {
				Type string `json:"type"`
				ID   string `json:"id"`
			} `json:"content"`
			StopReason string `json:"stop_reason"`
		}
		err = json.NewDecoder(resp.Body).Decode(&m)
		resp.Body.Close()
		if err != nil {
			t.Fatal(err)
		}
		if m.StopReason != "tool_use" || (stopAfter > 0 && calls == stopAfter) {
			return
		}
		var id string
		for _, b := range m.Content {
			if b.Type == "tool_use" {
				id = b.ID
			}
		}
		time.Sleep(toolTime)
		msgs = append(msgs, map[string]any{"role": "assistant", "content": m.Content},
			map[string]any{"role": "user", "content": []map[string]any{{"type": "tool_result", "tool_use_id": id, "content": "done"}}})
	}
}

// TestToolRecorder: the recorder times each tool call from the answer
// that asked for it to the request carrying its result, registers each
// episode of an environment with the model stand-in, and reports an
// episode that stopped early once the next one starts.
func TestToolRecorder(t *testing.T) {
	stub, err := modelstub.New(modelstub.Think{Fixed: true}, nil)
	if err != nil {
		t.Fatal(err)
	}
	rec := &toolRecorder{stub: stub, scripts: map[string]envScript{}, episodes: map[string]int{}, lastEnd: map[string]time.Time{}, ready: map[string]chan struct{}{}}
	step := func(name string) modelstub.Step {
		return modelstub.Step{Name: name, Tool: "Bash", Input: map[string]any{"command": name}}
	}
	script := modelstub.Script{Steps: []modelstub.Step{step("a"), step("b"), step("c")}, Final: "fixed"}
	rec.mu.Lock()
	rec.scripts["sys-00"] = envScript{task: episode.Task{ID: "task"}, script: script}
	ready := make(chan struct{})
	rec.ready["sys-00"] = ready
	rec.mu.Unlock()
	srv := httptest.NewServer(rec)
	defer srv.Close()

	const toolTime = 30 * time.Millisecond
	fakeAgent(t, srv.URL, "sys-00-ep1", toolTime, 0)
	select {
	case <-ready:
	default:
		t.Fatal("the environment's first request did not mark it ready")
	}
	calls := rec.latencies("sys", time.Time{}, time.Now().Add(time.Second))
	if len(calls) != 3 {
		t.Fatalf("%d tool calls recorded for a 3-step episode, want 3", len(calls))
	}
	for _, c := range calls {
		// A lower bound only: the agent slept that long before answering.
		if c < toolTime.Seconds() {
			t.Errorf("tool call of %.3fs recorded, shorter than the %s the tool took", c, toolTime)
		}
	}
	if got := rec.latencies("other", time.Time{}, time.Now().Add(time.Second)); len(got) != 0 {
		t.Errorf("another system's calls: %v", got)
	}
	// Episode 2 stops after one call; episode 3's start reports it.
	fakeAgent(t, srv.URL, "sys-00-ep2", 0, 1)
	// An episode that stopped sets no error of its own: only the next
	// one's start tells it did not complete.
	if f := rec.failures("sys"); len(f) != 0 {
		t.Fatalf("failures before episode 3: %v", f)
	}
	fakeAgent(t, srv.URL, "sys-00-ep3", 0, 0)
	f := rec.failures("sys")
	if len(f) != 1 || !strings.Contains(f[0], "sys-00 episode 2") {
		t.Fatalf("failures %v, want episode 2's early stop", f)
	}
	if n := rec.completed("sys"); n != 2 {
		t.Errorf("%d completed episodes, want 2 (episodes 1 and 3)", n)
	}
}

func TestDensityComparisonCeiling(t *testing.T) {
	rep := &DensityReport{Cores: 2, Order: []string{Envsnap, OverlayfsAll, StatusQuo}, Systems: map[string]*DensityRun{
		Envsnap:      {Held: 16, CPUCeiling: 20, Levels: []DensityLevel{{Envs: 1, EnvCPU: 0.1}}},
		StatusQuo:    {Held: 4},
		OverlayfsAll: {Held: 20},
	}}
	got := rep.Comparison()
	for _, want := range []string{"envsnap held 16, overlayfs-all held 20, status-quo held 4 (envsnap 4.0x the status quo)", "the node held 20, the bound", "(envsnap 0.80x of it)", "2 cores run about 20 environments", "(0.100 cores each"} {
		if !strings.Contains(got, want) {
			t.Errorf("comparison %q lacks %q", got, want)
		}
	}
}
