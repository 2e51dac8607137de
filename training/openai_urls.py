"""Routes of OpenAI's files, uploads and fine-tuning API under /v1/ (see training.openai_api, training.openai_uploads).

As OpenAI's SDK calls them: no trailing slash (one is accepted too).
"""

from django.urls import re_path

from training import openai_api as views
from training import openai_uploads as upload_views

_ID = r"(?P<{}>[^/]+)"
_FILE = _ID.format("file_id")
_JOB = _ID.format("job_id")
_UPLOAD = _ID.format("upload_id")

urlpatterns = [
    re_path(r"^files/?$", views.FilesView.as_view(), name="openai-files"),
    re_path(rf"^files/{_FILE}/?$", views.FileView.as_view(), name="openai-file"),
    re_path(rf"^files/{_FILE}/content/?$", views.FileContentView.as_view(), name="openai-file-content"),
    re_path(r"^uploads/?$", upload_views.UploadsView.as_view(), name="openai-uploads"),
    re_path(rf"^uploads/{_UPLOAD}/parts/?$", upload_views.UploadPartsView.as_view(), name="openai-upload-parts"),
    re_path(rf"^uploads/{_UPLOAD}/complete/?$", upload_views.UploadCompleteView.as_view(),
            name="openai-upload-complete"),
    re_path(rf"^uploads/{_UPLOAD}/cancel/?$", upload_views.UploadCancelView.as_view(), name="openai-upload-cancel"),
    re_path(r"^fine_tuning/jobs/?$", views.JobsView.as_view(), name="openai-jobs"),
    re_path(rf"^fine_tuning/jobs/{_JOB}/?$", views.JobView.as_view(), name="openai-job"),
    re_path(rf"^fine_tuning/jobs/{_JOB}/cancel/?$", views.JobCancelView.as_view(), name="openai-job-cancel"),
    re_path(rf"^fine_tuning/jobs/{_JOB}/pause/?$", views.JobPauseView.as_view(), name="openai-job-pause"),
    re_path(rf"^fine_tuning/jobs/{_JOB}/resume/?$", views.JobResumeView.as_view(), name="openai-job-resume"),
    re_path(rf"^fine_tuning/jobs/{_JOB}/events/?$", views.JobEventsView.as_view(), name="openai-job-events"),
    re_path(rf"^fine_tuning/jobs/{_JOB}/checkpoints/?$", views.JobCheckpointsView.as_view(),
            name="openai-job-checkpoints"),
]
