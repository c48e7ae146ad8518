package modelstub

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"
	"unicode/utf8"
)

// Server answers the Messages API for registered rollouts. Each rollout
// is one API key (x-api-key, or a bearer token): the agent in that
// environment is started with it.
type Server struct {
	think Think
	log   io.Writer
	// PingEvery is the period of the SSE ping events sent while thinking,
	// as the API keeps a slow stream alive.
	PingEvery time.Duration
	// OnFirstRequest, when set before the server serves, is called on a
	// goroutine of its own with a rollout's key at its first request:
	// the moment the environment became ready, while its agent waits on
	// the model.
	OnFirstRequest func(key string)
	now            func() time.Time
	sleep          func(r *http.Request, d time.Duration) error

	mu       sync.Mutex
	rollouts map[string]*rollout
	logMu    sync.Mutex
}

type rollout struct {
	sample string
	script Script
	out    Outcome
}

// Outcome is what the server saw of one rollout.
type Outcome struct {
	Sample string `json:"sample"`
	// FirstRequest is when the agent first called the model: the
	// environment was ready.
	FirstRequest time.Time `json:"first_request"`
	LastAnswer   time.Time `json:"last_answer"`
	Requests     int       `json:"requests"`
	// SideRequests were not part of the agent's loop (no tools offered,
	// e.g. a title or a summary); answered at once with a short text.
	SideRequests int `json:"side_requests"`
	// Steps is how many scripted tool calls the agent returned results
	// for; Done that it then asked for the final answer and got it.
	Steps int  `json:"steps"`
	Done  bool `json:"done"`
	// Err is why the rollout failed; empty while it has not.
	Err string `json:"error,omitempty"`
	// Think is the total time the model spent on this rollout's answers.
	Think time.Duration `json:"think_ns"`
	// UserAgent is the agent's User-Agent header (its name and release).
	UserAgent string `json:"user_agent"`
}

// New returns a server with think times from t, logging every turn to
// log (one JSON object a line; nil discards).
func New(t Think, log io.Writer) (*Server, error) {
	if err := t.Validate(); err != nil {
		return nil, err
	}
	if log == nil {
		log = io.Discard
	}
	return &Server{think: t, log: log, PingEvery: 5 * time.Second, now: time.Now, sleep: sleepCtx, rollouts: map[string]*rollout{}}, nil
}

func sleepCtx(r *http.Request, d time.Duration) error {
	if d <= 0 {
		return nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-r.Context().Done():
		return r.Context().Err()
	}
}

// Register makes key a rollout of sample (think times are drawn per
// sample and turn, so the same sample gets the same model in every
// system) running s. Registering a key again starts it afresh.
func (s *Server) Register(key, sample string, sc Script) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.rollouts[key] = &rollout{sample: sample, script: sc, out: Outcome{Sample: sample}}
}

// Outcome is what the server saw of key's rollout; false when key was
// never registered.
func (s *Server) Outcome(key string) (Outcome, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r, ok := s.rollouts[key]
	if !ok {
		return Outcome{}, false
	}
	return r.out, true
}

// Verdict is nil when key's rollout completed its script: every tool
// result passed its check and the final answer was given.
func (o Outcome) Verdict() error {
	switch {
	case o.Err != "":
		return errors.New(o.Err)
	case o.Requests == 0:
		return errors.New("the agent never called the model")
	case !o.Done:
		return fmt.Errorf("the agent stopped after %d of the script's tool calls without asking for the final answer", o.Steps)
	}
	return nil
}

// Request bodies: only what the server reads.
type request struct {
	Model     string    `json:"model"`
	Messages  []message `json:"messages"`
	Tools     []tool    `json:"tools"`
	Stream    bool      `json:"stream"`
	MaxTokens int       `json:"max_tokens"`
}

type tool struct {
	Name string `json:"name"`
}

type message struct {
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"`
}

type block struct {
	Type      string          `json:"type"`
	Text      string          `json:"text,omitempty"`
	ID        string          `json:"id,omitempty"`
	Name      string          `json:"name,omitempty"`
	Input     json.RawMessage `json:"input,omitempty"`
	ToolUseID string          `json:"tool_use_id,omitempty"`
	Content   json.RawMessage `json:"content,omitempty"`
	IsError   bool            `json:"is_error,omitempty"`
}

// blocks decodes a message's content: a string is one text block.
func (m message) blocks() []block {
	var s string
	if json.Unmarshal(m.Content, &s) == nil {
		return []block{{Type: "text", Text: s}}
	}
	var bs []block
	_ = json.Unmarshal(m.Content, &bs)
	return bs
}

// text joins a tool result's content: a string, or text blocks.
func (b block) text() string {
	var s string
	if json.Unmarshal(b.Content, &s) == nil {
		return s
	}
	var bs []block
	_ = json.Unmarshal(b.Content, &bs)
	var parts []string
	for _, c := range bs {
		if c.Type == "text" {
			parts = append(parts, c.Text)
		}
	}
	return strings.Join(parts, "\n")
}

// results collects the results of the scripted calls from a
// conversation, in step order; it stops at the first step without one.
func results(prefix string, msgs []message) []Result {
	byID := map[string]Result{}
	for _, m := range msgs {
		if m.Role != "user" {
			continue
		}
		for _, b := range m.blocks() {
			if b.Type == "tool_result" {
				byID[b.ToolUseID] = Result{Text: b.text(), IsError: b.IsError}
			}
		}
	}
	var out []Result
	for i := 0; ; i++ {
		r, ok := byID[ToolUseID(prefix, i)]
		if !ok {
			return out
		}
		out = append(out, r)
	}
}

func apiKey(r *http.Request) string {
	if k := r.Header.Get("x-api-key"); k != "" {
		return k
	}
	return strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer ")
}

// ServeHTTP serves POST /v1/messages (streaming or not) and
// /v1/messages/count_tokens; anything else is logged and answered 404.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	key := apiKey(r)
	path := r.URL.Path
	switch {
	case r.Method == http.MethodPost && path == "/v1/messages/count_tokens":
		body, _ := io.ReadAll(r.Body)
		s.logf(key, map[string]any{"event": "count_tokens"})
		writeJSON(w, http.StatusOK, map[string]any{"input_tokens": len(body) / 4})
	case r.Method == http.MethodPost && path == "/v1/messages":
		s.messages(w, r, key)
	default:
		s.logf(key, map[string]any{"event": "unknown", "method": r.Method, "path": path})
		apiError(w, http.StatusNotFound, "not_found_error", "the model stand-in serves /v1/messages only")
	}
}

func (s *Server) messages(w http.ResponseWriter, r *http.Request, key string) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		apiError(w, http.StatusBadRequest, "invalid_request_error", "read body: "+err.Error())
		return
	}
	var req request
	if err := json.Unmarshal(body, &req); err != nil {
		s.logf(key, map[string]any{"event": "bad_request", "error": err.Error()})
		apiError(w, http.StatusBadRequest, "invalid_request_error", "decode body: "+err.Error())
		return
	}
	now := s.now()
	s.mu.Lock()
	ro, ok := s.rollouts[key]
	if !ok {
		s.mu.Unlock()
		s.logf(key, map[string]any{"event": "unknown_key"})
		apiError(w, http.StatusUnauthorized, "authentication_error", "no rollout registered for this API key")
		return
	}
	ro.out.Requests++
	if ro.out.FirstRequest.IsZero() {
		ro.out.FirstRequest, ro.out.UserAgent = now, r.UserAgent()
		if s.OnFirstRequest != nil {
			go s.OnFirstRequest(key)
		}
	}
	script, sample := ro.script, ro.sample
	side := !offers(req.Tools, script)
	var d Decision
	if side {
		ro.out.SideRequests++
	} else {
		d = Next(script, results(key, req.Messages))
	}
	s.mu.Unlock()

	in := len(body) / 4
	if side {
		// Not the agent's loop: a short answer at once, so it does not
		// stand for model time.
		s.logf(key, map[string]any{"event": "side", "model": req.Model, "messages": len(req.Messages), "tools": len(req.Tools)})
		s.answer(w, r, req, key, 0, in, []block{{Type: "text", Text: "OK."}}, "end_turn")
		return
	}
	think := s.think.Draw(sample, d.Step)
	ev := map[string]any{"event": "turn", "sample": sample, "turn": d.Step + 1, "think_ms": think.Milliseconds(), "messages": len(req.Messages)}
	var content []block
	stop := "end_turn"
	switch d.Action {
	case CallTool:
		st := script.Steps[d.Step]
		input, _ := json.Marshal(st.Input)
		content = []block{{Type: "text", Text: "Next: " + st.Name + "."}, {Type: "tool_use", ID: ToolUseID(key, d.Step), Name: st.Tool, Input: input}}
		stop = "tool_use"
		ev["step"], ev["tool"] = st.Name, st.Tool
	case Answer:
		content = []block{{Type: "text", Text: script.Final}}
		ev["step"] = "final"
	case Fail:
		content = []block{{Type: "text", Text: "Rollout failed: " + d.Err.Error()}}
		think = 0
		ev["step"], ev["error"], ev["think_ms"] = "failed", d.Err.Error(), 0
	}
	s.logf(key, ev)
	if err := s.answer(w, r, req, key, think, in, content, stop); err != nil {
		s.logf(key, map[string]any{"event": "answer_error", "turn": d.Step + 1, "error": err.Error()})
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if ro, ok = s.rollouts[key]; !ok {
		return
	}
	ro.out.LastAnswer = s.now()
	ro.out.Think += think
	ro.out.Steps = max(ro.out.Steps, d.Step)
	switch d.Action {
	case Answer:
		ro.out.Done = true
	case Fail:
		if ro.out.Err == "" {
			ro.out.Err = d.Err.Error()
		}
	}
}

// offers reports whether the request offers every tool the script calls:
// the agent's main loop does, its side queries do not.
func offers(tools []tool, sc Script) bool {
	for _, st := range sc.Steps {
		found := false
		for _, t := range tools {
			found = found || t.Name == st.Tool
		}
		if !found {
			return false
		}
	}
	return true
}

// answer writes one assistant message after think, as a stream of
// server-sent events when the request asked for one.
func (s *Server) answer(w http.ResponseWriter, r *http.Request, req request, key string, think time.Duration, inTokens int, content []block, stop string) error {
	id := fmt.Sprintf("msg_%s_%d", key, s.now().UnixNano())
	model := req.Model
	outTokens := 0
	for _, b := range content {
		outTokens += (len(b.Text) + len(b.Input)) / 4
	}
	usage := map[string]any{"input_tokens": inTokens, "output_tokens": outTokens, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
	if !req.Stream {
		if err := s.sleep(r, think); err != nil {
			return err
		}
		msg := map[string]any{"id": id, "type": "message", "role": "assistant", "model": model, "content": content,
			"stop_reason": stop, "stop_sequence": nil, "usage": usage}
		writeJSON(w, http.StatusOK, msg)
		return nil
	}
	fl, ok := w.(http.Flusher)
	if !ok {
		return errors.New("response writer cannot stream")
	}
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	send := func(event string, data any) error {
		b, err := json.Marshal(data)
		if err != nil {
			return err
		}
		if _, err := fmt.Fprintf(w, "event: %s\ndata: %s\n\n", event, b); err != nil {
			return err
		}
		fl.Flush()
		return nil
	}
	start := map[string]any{"id": id, "type": "message", "role": "assistant", "model": model, "content": []any{},
		"stop_reason": nil, "stop_sequence": nil, "usage": map[string]any{"input_tokens": inTokens, "output_tokens": 1}}
	if err := send("message_start", map[string]any{"type": "message_start", "message": start}); err != nil {
		return err
	}
	// The model thinks with the stream open, pinging as the API does.
	deadline := s.now().Add(think)
	for {
		left := deadline.Sub(s.now())
		if left <= 0 {
			break
		}
		if err := s.sleep(r, min(left, s.PingEvery)); err != nil {
			return err
		}
		if err := send("ping", map[string]any{"type": "ping"}); err != nil {
			return err
		}
	}
	for i, b := range content {
		switch b.Type {
		case "text":
			if err := send("content_block_start", map[string]any{"type": "content_block_start", "index": i, "content_block": map[string]any{"type": "text", "text": ""}}); err != nil {
				return err
			}
			for _, chunk := range split(b.Text, 40) {
				if err := send("content_block_delta", map[string]any{"type": "content_block_delta", "index": i, "delta": map[string]any{"type": "text_delta", "text": chunk}}); err != nil {
					return err
				}
			}
		case "tool_use":
			if err := send("content_block_start", map[string]any{"type": "content_block_start", "index": i,
				"content_block": map[string]any{"type": "tool_use", "id": b.ID, "name": b.Name, "input": map[string]any{}}}); err != nil {
				return err
			}
			for _, chunk := range split(string(b.Input), 40) {
				if err := send("content_block_delta", map[string]any{"type": "content_block_delta", "index": i, "delta": map[string]any{"type": "input_json_delta", "partial_json": chunk}}); err != nil {
					return err
				}
			}
		}
		if err := send("content_block_stop", map[string]any{"type": "content_block_stop", "index": i}); err != nil {
			return err
		}
	}
	if err := send("message_delta", map[string]any{"type": "message_delta", "delta": map[string]any{"stop_reason": stop, "stop_sequence": nil},
		"usage": map[string]any{"output_tokens": outTokens}}); err != nil {
		return err
	}
	return send("message_stop", map[string]any{"type": "message_stop"})
}

// split cuts s into pieces of about n bytes, on rune boundaries (the API
// streams text and tool input in fragments; a client must join them).
func split(s string, n int) []string {
	var out []string
	for len(s) > n {
		i := n
		for i > 0 && !utf8.RuneStart(s[i]) {
			i--
		}
		if i == 0 {
			i = n
		}
		out = append(out, s[:i])
		s = s[i:]
	}
	return append(out, s)
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}

func apiError(w http.ResponseWriter, code int, kind, msg string) {
	writeJSON(w, code, map[string]any{"type": "error", "error": map[string]any{"type": kind, "message": msg}})
}

func (s *Server) logf(key string, fields map[string]any) {
	fields["time"] = s.now().UTC().Format(time.RFC3339Nano)
	fields["rollout"] = key
	b, _ := json.Marshal(fields)
	s.logMu.Lock()
	defer s.logMu.Unlock()
	_, _ = s.log.Write(append(b, '\n'))
}
