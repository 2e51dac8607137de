"""Routes of OpenAI's files and fine-tuning API under /v1/ (see training.openai_api).

As OpenAI's SDK calls them: no trailing slash (one is accepted too).
"""

from django.urls import re_path

from training import openai_api as views

_ID = r"(?P<{}>[^/]+)"
_FILE = _ID.format("file_id")
_JOB = _ID.format("job_id")

urlpatterns = [
    re_path(r"^files/?$", views.FilesView.as_view(), name="openai-files"),
    re_path(rf"^files/{_FILE}/?$", views.FileView.as_view(), name="openai-file"),
    re_path(rf"^files/{_FILE}/content/?$", views.FileContentView.as_view(), name="openai-file-content"),
    re_path(r"^fine_tuning/jobs/?$", views.JobsView.as_view(), name="openai-jobs"),
    re_path(rf"^fine_tuning/jobs/{_JOB}/?$", views.JobView.as_view(), name="openai-job"),
    re_path(rf"^fine_tuning/jobs/{_JOB}/cancel/?$", views.JobCancelView.as_view(), name="openai-job-cancel"),
    re_path(rf"^fine_tuning/jobs/{_JOB}/events/?$", views.JobEventsView.as_view(), name="openai-job-events"),
    re_path(rf"^fine_tuning/jobs/{_JOB}/checkpoints/?$", views.JobCheckpointsView.as_view(),
            name="openai-job-checkpoints"),
]
