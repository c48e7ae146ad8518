// Package modelstub is the model of the rollout benchmark: an HTTP server
// speaking the Messages API (streaming, as the agent CLI calls it) that
// replays a per-task script of tool calls and waits a think time before
// each answer, as a model generating on GPUs elsewhere would.
//
// # Invariant
//
// A rollout passes only when the agent ran every scripted tool call and
// each result the script checks says what it must (the tests fail before
// the fix and pass after it, the diff is there), and the agent then asked
// for the final answer. A wrong result ends the conversation with a
// failure the benchmark reports; a conversation that stops early is
// incomplete, never a pass.
//
// The server is stateless about the conversation: which step comes next
// is a pure function of the messages the agent sends (Next), so a retried
// request gets the same answer. It only records what it saw, per rollout,
// for the benchmark (Outcome) and the log.
package modelstub

import (
	"fmt"
	"strings"
	"time"
)

// Step is one scripted tool call and the check of its result.
type Step struct {
	Name  string         // for logs and failures: "test-before"
	Tool  string         // the agent's tool name: "Bash", "Read"
	Input map[string]any // the tool's input
	// Check judges the tool result the agent returned; nil accepts any.
	Check func(Result) error
}

// BashMaxTimeout is the longest timeout the agent CLI's Bash tool takes.
const BashMaxTimeout = 10 * time.Minute

// Result is what the agent returned for a tool call.
type Result struct {
	Text    string // the tool result's text, blocks joined
	IsError bool   // the agent marked it an error (a command's exit code was not 0)
}

// Script is one task's episode: the tool calls in order, then a final
// answer.
type Script struct {
	Steps []Step
	// Final is the last answer's text. The benchmark looks for it in the
	// agent's output: the agent printed the model's final answer.
	Final string
}

// EpisodeScript is the episode bench/workload/evaluator/episode.sh runs,
// as tool calls: look around the repository, read what the fix touches,
// run the failing tests, apply the fix, test again, show the diff. fix is
// the fix's path inside the environment, touched the files it changes
// (relative to repo).
func EpisodeScript(repo, fix string, touched []string, final string) Script {
	bash := func(name, cmd string, check func(Result) error) Step {
		return Step{Name: name, Tool: "Bash", Input: map[string]any{"command": "cd " + repo + " && " + cmd, "description": name}, Check: check}
	}
	// A test run may outlast the Bash tool's default timeout (2 minutes)
	// in a starved environment: the model asks for the tool's longest
	// (10 minutes), as an agent expecting a slow suite does, so a slow
	// environment shows as time, and only a stuck one as a failure.
	test := func(name string, check func(Result) error) Step {
		st := bash(name, "go test ./...", check)
		st.Input["timeout"] = BashMaxTimeout.Milliseconds()
		return st
	}
	read := func(name, path string, check func(Result) error) Step {
		return Step{Name: name, Tool: "Read", Input: map[string]any{"file_path": path}, Check: check}
	}
	steps := []Step{
		bash("git-status", "git status", all(ok, contains("On branch"))),
		bash("git-log", "git log --oneline -5", ok),
		bash("list-files", "git ls-files", all(ok, contains("go.mod"))),
		bash("grep-funcs", "grep -rn --include='*.go' -m 3 '^func ' .", all(ok, contains("func "))),
		read("read-go-mod", repo+"/go.mod", contains("module ")),
	}
	for _, f := range touched {
		steps = append(steps, read("read-"+f, repo+"/"+f, contains("package ")))
	}
	steps = append(steps,
		// The task's bug is applied: its tests must fail, or the fix
		// proves nothing.
		test("test-before", all(failed, contains("FAIL"))),
		bash("apply-fix", "git apply "+fix, ok),
		test("test-after", all(ok, contains("ok "), lacks("FAIL"))),
		// The fix is the bug's reverse: afterwards the tree is the
		// repository's last commit again.
		bash("git-diff", "git diff --stat; echo diff-lines=$(git diff | wc -l)", all(ok, contains("diff-lines=0"))),
	)
	return Script{Steps: steps, Final: final}
}

func ok(r Result) error {
	if r.IsError {
		return fmt.Errorf("the command failed: %s", excerpt(r.Text))
	}
	return nil
}

func failed(r Result) error {
	if !r.IsError {
		return fmt.Errorf("the command succeeded, want a failure: %s", excerpt(r.Text))
	}
	return nil
}

func contains(s string) func(Result) error {
	return func(r Result) error {
		if !strings.Contains(r.Text, s) {
			return fmt.Errorf("result lacks %q: %s", s, excerpt(r.Text))
		}
		return nil
	}
}

func lacks(s string) func(Result) error {
	return func(r Result) error {
		if strings.Contains(r.Text, s) {
			return fmt.Errorf("result has %q: %s", s, excerpt(r.Text))
		}
		return nil
	}
}

func all(checks ...func(Result) error) func(Result) error {
	return func(r Result) error {
		for _, c := range checks {
			if err := c(r); err != nil {
				return err
			}
		}
		return nil
	}
}

func excerpt(s string) string {
	s = strings.TrimSpace(s)
	if len(s) > 300 {
		s = s[:150] + " ... " + s[len(s)-150:]
	}
	return fmt.Sprintf("%q", s)
}

// Action is what the model answers next.
type Action int

const (
	CallTool Action = iota // the next step's tool call
	Answer                 // the final answer: every step done
	Fail                   // a result was wrong or out of order: stop
)

// Decision is Next's verdict.
type Decision struct {
	Action Action
	Step   int   // the step to call (CallTool), or how many were done
	Err    error // why (Fail)
}

// ToolUseID names step i's tool call: the agent echoes it back with the
// result, which is how a later request says which steps are done.
func ToolUseID(prefix string, i int) string { return fmt.Sprintf("toolu_%s_%02d", prefix, i) }

// Next decides the answer to a request whose conversation returned
// results for the scripted calls in order (results[i] for step i, as
// found by their ToolUseID): the next call, the final answer, or a
// failure when a result fails its step's check.
func Next(s Script, results []Result) Decision {
	if len(results) > len(s.Steps) {
		return Decision{Action: Fail, Step: len(s.Steps), Err: fmt.Errorf("%d tool results for a script of %d steps", len(results), len(s.Steps))}
	}
	for i, r := range results {
		if c := s.Steps[i].Check; c != nil {
			if err := c(r); err != nil {
				return Decision{Action: Fail, Step: i, Err: fmt.Errorf("step %d (%s): %w", i+1, s.Steps[i].Name, err)}
			}
		}
	}
	if len(results) == len(s.Steps) {
		return Decision{Action: Answer, Step: len(results)}
	}
	return Decision{Action: CallTool, Step: len(results)}
}
