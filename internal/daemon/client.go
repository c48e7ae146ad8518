package daemon

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"strings"
)

// GetStatus asks a running daemon for its status. target is either the
// daemon's gRPC socket path (its status socket is found beside it) or an
// http://host:port metrics address.
func GetStatus(ctx context.Context, target string) (Status, error) {
	var st Status
	url := strings.TrimSuffix(target, "/") + "/status"
	client := http.DefaultClient
	if !strings.HasPrefix(target, "http://") && !strings.HasPrefix(target, "https://") {
		sock := StatusSocket(target)
		client = &http.Client{Transport: &http.Transport{
			DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
				var d net.Dialer
				return d.DialContext(ctx, "unix", sock)
			},
		}}
		url = "http://envsnap/status"
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return st, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return st, fmt.Errorf("query daemon status: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return st, fmt.Errorf("query daemon status: %s", resp.Status)
	}
	if err := json.NewDecoder(resp.Body).Decode(&st); err != nil {
		return st, fmt.Errorf("decode daemon status: %w", err)
	}
	return st, nil
}
